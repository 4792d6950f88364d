"""Models before and while they load: where a model is and its shape, the built-in tiny model, GGUF wheels, prompts."""
