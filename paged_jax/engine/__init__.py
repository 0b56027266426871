"""Requests in, outputs out: LLMEngine (schedule, execute, update; tokenization, detokenization,
stop strings and beam orchestration) and the offline LLM, plus engine statistics."""
