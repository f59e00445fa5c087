"""The worker core: model weights and code, the paged KV cache and swap space, step execution, sampling."""
