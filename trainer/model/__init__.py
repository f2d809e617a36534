"""The model: load it (dtype, attention backend, quantization, LoRA, heads), fit the attention backend to its
class, and everything that changes its layers (kernels, QAT, BitNet, sparsity, ReLoRA, LoftQ)."""
