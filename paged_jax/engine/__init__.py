"""Requests in, outputs out: the engine core (scheduler, block manager, runner; token ids
only), its front end (prompt processing, incremental detokenization, stop strings), the
LLMEngine that joins them, the offline LLM, and engine statistics."""
