"""Compile every Triton kernel of pagoda/ops/triton_ops.py for an H100/H200 (sm_90),
on the CPU: Triton's own front end and its bundled ptxas, no GPU or driver needed.
What the interpreter (TRITON_INTERPRET=1) lets through and a GPU would not (tile
shapes tl.dot refuses, non-power-of-2 aranges, type errors in the lowering, register
spills) fails here. Run in a process of its own, without the interpreter
(tests/kernels/test_triton_kernels.py does); prints one line per kernel and exits 1 if
any failed.

    python tests/kernels/compile_triton_kernels.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagoda.ops import triton_ops as ops  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # Hopper: an H100 or H200


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


def stack_bytes(cubin: bytes) -> int | None:
    """The kernel's stack frame (registers spilled to local memory), by cuobjdump
    (bundled with Triton); None where it cannot tell (a failure: spills unchecked)."""
    if not os.path.exists(CUOBJDUMP):
        print(f"(no {CUOBJDUMP})")
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True)
    found = re.search(r"STACK:(\d+)", usage.stdout)
    return int(found.group(1)) if found else None


def compile_kernel(
    fn, types: dict[str, str], constants: dict, label: str, num_warps: int = 4
) -> bool:
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    try:
        kernel = triton.compile(
            ASTSource(fn, signature, constants), target=TARGET, options={"num_warps": num_warps}
        )
    except Exception as e:  # noqa: BLE001 (report every kernel, then fail)
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}")
        return False
    stack = stack_bytes(kernel.asm["cubin"])
    if stack is None:
        print(f"FAIL {label}: cuobjdump gave no stack size, so spills were not checked")
        return False
    if stack:  # a spill: slow, and the sign of a tile too large for the registers
        print(f"FAIL {label}: {stack} bytes of registers spilled to the stack")
        return False
    print(f"ok   {label}")
    return True


def main() -> int:
    results = []
    ints = dict.fromkeys(["stride_tb", "stride_kn", "stride_kb", "stride_kh"], "i64")
    for dt in ("fp32", "bf16", "fp16"):
        precision = "ieee" if dt == "fp32" else "tf32"
        # (query heads per KV head, head_dim, block_size): SmolLM2-135M, Llama-3-8B, a
        # wide group (tl.dot's path), a larger block, Gemma 3's 256-wide heads.
        for group, d, bs in ((3, 64, 16), (4, 128, 16), (16, 128, 16), (8, 128, 32), (4, 256, 16)):
            attention = dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", scale="fp32", **ints)
            decode = dict(attention, tables_ptr="*i64", lens_ptr="*i64", m_ptr="*fp32",
                          l_ptr="*fp32", acc_ptr="*fp32", window="i32", softcap="fp32",
                          min_blocks="i32", num_splits="i32")  # fmt: skip
            heads = dict(H=group * 3, GROUP=group, D=d, BLOCK_SIZE=bs, PRECISION=precision)
            label = f"{dt} group {group} head_dim {d} block {bs}"
            # Soft-capped logits (Gemma 2) on the widest group only: the other paths are
            # the same code.
            for softcap in (False, True) if group == 16 else (False,):
                tag = f"{label}{', soft cap' if softcap else ''}"
                results.append(compile_kernel(
                    ops._decode_partial, decode,
                    dict(heads, GROUP_PAD=ops.group_pad(group), MAX_SPLITS=ops.MAX_SPLITS,
                         SOFTCAP=softcap, R=0),
                    f"decode partial, {tag}",
                ))  # fmt: skip
                prefill = dict(attention, o_ptr=f"*{dt}", starts_ptr="*i64", qlens_ptr="*i64",
                               ctx_ptr="*i64", tables_ptr="*i64", window="i32",
                               softcap="fp32")  # fmt: skip
                results.append(compile_kernel(
                    ops._prefill_attention, prefill, dict(heads, BLOCK_M=16, SOFTCAP=softcap),
                    f"prefill, {tag}",
                ))  # fmt: skip
        # MLA's latent rows (DeepSeek: 512 latent + 64 rope dims, 16 heads a KV head).
        results.append(compile_kernel(
            ops._decode_partial, decode,
            dict(H=16, GROUP=16, GROUP_PAD=16, D=512, BLOCK_SIZE=16, PRECISION=precision,
                 MAX_SPLITS=ops.MAX_SPLITS, SOFTCAP=False, R=64),
            f"decode partial, latent rows, {dt}", num_warps=ops.LATENT_NUM_WARPS,
        ))  # fmt: skip
        merge = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", o_ptr=f"*{dt}",
                     lens_ptr="*i64", window="i32", min_blocks="i32", num_splits="i32")  # fmt: skip
        results.append(compile_kernel(
            ops._decode_merge, merge,
            dict(H=9, D=128, BLOCK_SIZE=16, MAX_SPLITS=ops.MAX_SPLITS), f"decode merge, {dt}",
        ))  # fmt: skip
        results += [
            compile_kernel(
                ops._add_rms_norm, dict(x_ptr=f"*{dt}", res_ptr=f"*{dt}", w_ptr=f"*{dt}",
                                        n="i32", eps="fp32"),
                dict(BLOCK=4096, GEMMA=False), f"add_rms_norm, {dt}",
            ),
            compile_kernel(  # Gemma's: a float32 (1 + w) weight, rounded after it
                ops._add_rms_norm, dict(x_ptr=f"*{dt}", res_ptr=f"*{dt}", w_ptr="*fp32",
                                        n="i32", eps="fp32"),
                dict(BLOCK=4096, GEMMA=dt != "fp32"), f"add_rms_norm (Gemma), {dt}",
            ),
            compile_kernel(
                ops._rotary, dict(qk_ptr=f"*{dt}", pos_ptr="*i64", cos_ptr="*fp32",
                                  sin_ptr="*fp32", heads="i32"),
                dict(D=64, HALF=32, HALF_PAD=32), f"rotary, {dt}",
            ),
            compile_kernel(  # partial rotary (Phi-4-mini: 96 of 128 dims)
                ops._rotary, dict(qk_ptr=f"*{dt}", pos_ptr="*i64", cos_ptr="*fp32",
                                  sin_ptr="*fp32", heads="i32"),
                dict(D=128, HALF=48, HALF_PAD=64), f"rotary, partial, {dt}",
            ),
            compile_kernel(
                ops._silu_and_mul, dict(x_ptr=f"*{dt}", o_ptr=f"*{dt}", inter="i32"),
                dict(BLOCK=1024), f"silu_and_mul, {dt}",
            ),
            compile_kernel(
                ops._write_kv, dict(k_ptr=f"*{dt}", v_ptr=f"*{dt}", kc_ptr=f"*{dt}",
                                    vc_ptr=f"*{dt}", slot_ptr="*i64"),
                dict(ROW=192, ROW_PAD=256), f"write_kv, {dt}",
            ),
        ]  # fmt: skip
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
