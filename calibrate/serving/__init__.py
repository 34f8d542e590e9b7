"""Running a real LLM server (vLLM) locally, talking to it, and measuring it.

``tiny_model`` writes a small random-weight Llama folder that vLLM serves with
no model hub (needs torch and transformers); ``launch`` starts and stops a
vLLM OpenAI-compatible server as a subprocess; ``client`` is a streaming
client that replays a timed schedule of token-id prompts and records every
token's arrival time. ``launch`` and ``client`` use the standard library only
(``launch`` needs vLLM in the interpreter it starts).
"""
