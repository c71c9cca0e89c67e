"""Where the Gemma 4 language model lives in each Hugging Face class's checkpoint (no imports: cheap)."""

#: HF class → prefix of its language-model tensors (the VL checkpoint nests the text model).
LANGUAGE_MODEL_PREFIX = {
    "Gemma4ForCausalLM": "model.",
    "Gemma4ForConditionalGeneration": "model.language_model.",
}
