"""Running a real vLLM server locally and talking to it.

``tiny_model`` writes a small random-weight Llama folder that vLLM serves with
no model hub; ``launch`` starts and stops a vLLM OpenAI-compatible server as a
subprocess; ``client`` is a dependency-free streaming client that replays a
timed schedule of token-id prompts and records every token's arrival time.
Only ``tiny_model`` needs torch; ``client`` and ``launch`` use the standard
library alone (``launch`` needs vLLM in the interpreter it starts).
"""
