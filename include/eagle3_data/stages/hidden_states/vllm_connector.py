"""vLLM's hidden-states KV connector, made to run on CPU.

Imported only inside the vLLM venv (`.venv-vllm`), by vLLM itself through
`kv_connector_module_path`. The stock `ExampleHiddenStatesConnector` copies the captured states
out of the cache with a CUDA stream, a CUDA event and pinned host memory (`pin_memory=True`
fails without CUDA). On CPU the cache already lives in host memory, so this subclass gathers
the request's slots and writes its safetensors file synchronously, in the same step; the lock
file protocol, the file layout (`hidden_states` [T, n_layers, H], `token_ids` [T]) and the
scheduler side are the stock ones. On CUDA the worker uses the stock connector.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous host copy instead of stream + event."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader on LOCK_SH may go on
        # get_finished reports a request "done sending" (so its blocks are freed) only once it
        # holds a copy event that has completed: this copy is complete already.
        self._req_copy_events[pending.req_id] = _DoneEvent()


class _DoneEvent:
    """Stands in for the `torch.cuda.Event` of a copy that already finished."""

    def query(self) -> bool:
        return True
