"""Engine: requests, scheduling over the paged KV cache, the step loop, sampling, tokenizer."""
