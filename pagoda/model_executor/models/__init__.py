"""Model registry: architecture name -> nn.Module class."""

from pagoda.model_executor.models.llama import LlamaForCausalLM
from pagoda.model_executor.models.llava import LlavaForConditionalGeneration

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama with (optional) sliding window
    "Qwen2ForCausalLM": LlamaForCausalLM,  # Llama with q/k/v bias
    # Mixture of experts: Llama with SparseMoeBlock MLPs.
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,  # and q/k/v bias, a shared expert
    "OlmoeForCausalLM": LlamaForCausalLM,  # and q/k norms
    # Vision-language: a vision encoder and projector feeding a Llama-family model.
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}
