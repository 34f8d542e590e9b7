"""A scheduler-side KV connector for vLLM's own ``Scheduler`` whose answers a differential
case controls (``calibrate.serving.vllm_diff``): the decode instance of disaggregated serving
as vLLM's NixlConnector makes it (``nixl/pull_scheduler.py``): a request marked remote loads
the prompt beyond its local prefix hit asynchronously (``get_num_new_matched_tokens`` answers
prompt - hit, True), is asked once (``update_state_after_alloc`` clears the mark, as the
connector clears ``do_remote_prefill``), and its worker side does nothing: when a load ends is
the case's to say, through the model output's ``kv_connector_output.finished_recving``.

Importing this module imports vLLM; it is loaded by name through
``KVTransferConfig.kv_connector_module_path``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)


class Script:
    """What the connector answers: ``remote``, the ids (vLLM's strings) of the requests whose
    prompt another instance computed; ``allocated``, the ids whose blocks were allocated for a
    load, in order (the reference takes them after each ``schedule``)."""

    def __init__(self, remote: set[str]) -> None:
        self.remote = remote
        self.allocated: list[str] = []


ACTIVE: Script | None = None       # the script of the connector built next


class ScriptedConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if ACTIVE is None:
            raise RuntimeError("calibrate.serving.vllm_connector.ACTIVE must hold a Script first")
        self.script = ACTIVE

    # ---- worker side: nothing runs ------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self.script.remote:
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if request.request_id in self.script.remote and num_external_tokens:
            self.script.remote.discard(request.request_id)
            self.script.allocated.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None
