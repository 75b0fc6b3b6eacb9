"""The real model: weights, tokenizer, a Llama-family network with paged attention, the
sampler and the runner that implements the core's Executor protocol. torch lives here only."""
