"""Data-parallel ranks of a mixture-of-experts model, stepping together.

vLLM's ``--data-parallel-size d`` runs d engine cores behind one API server, each with its own
scheduler and KV pool (batchsim: one ``Server`` a rank, fed by the ``vllm_dp`` router); SGLang's
``--dp d --enable-dp-attention`` likewise (the ``sglang_dp`` router: its controller's round robin;
``sglang/srt/managers/scheduler_components/dp_attn.py``, ``prepare_mlp_sync_batch_raw``, for the
lockstep: a rank with no batch runs an idle one). A dense
model's ranks are independent replicas. An MoE model's are not: every MoE layer's collectives
(the experts meet the tokens of all ranks) take every rank, so the ranks run each forward pass
together, a rank with nothing to run joining with a dummy batch (``DPEngineCoreProc``'s
``execute_dummy_batch``), and vLLM pads every rank's batch to the largest one's token count
(``coordinate_batch_across_dp``; exact under CUDA graphs, and above the graph sizes the
layers' collectives wait for the largest rank all the same). ``DpGroup`` is that loop:

1. Every rank's policy chooses its step at the same instant (``schedule``), from its own
   queues and pool.
2. If no rank has work, the group waits for the next arrival at any rank (or the earliest
   deadline a policy gave).
3. The step (``Profile.dp_step_time_s``): while every rank's batch fits a CUDA graph
   (``graph_tokens``: vLLM's max_cudagraph_capture_size, min(2 x max_num_seqs, 512; 1024 on
   B200/B300/GB200/GB300)), every rank runs its token-parallel ops and the experts at the
   largest rank's token count (vLLM's DP padding); above, each rank runs its own tokens and
   the experts meet all the ranks' (priced at their mean a rank). Routing is uniform unless
   ``profile.expert_imbalance`` says by how much the busiest rank's experts get more tokens
   than the mean (the experts are then priced at that many). Each rank adds its own
   attention, LM head and overheads; the group's step is the slowest rank's, and every rank's
   step starts and ends with it. SGLang's DP attention (``pads_prefill`` False: policy sglang,
   rule 9) pads only a step in which no rank extends, up to its decode graphs' largest batch
   (``DpPaddingMode``: MAX_LEN under the decode graphs; an extend step SUM_LEN, each rank its
   own tokens); its gather and scatter around the MoE layers are priced as vLLM's.
4. Each rank with a batch commits it at the step's end and logs it with the group's duration;
   a dummy batch is not logged.

The synchronous loop only: vLLM's async scheduling, the fast paths (decode stretches) and
speculative decoding are not modelled with data parallelism (refused where asked:
sim.run.runner); nor are the coordinator's wave bookkeeping and its every-32-steps check
that all ranks are idle (a rank here stops the moment no rank has work).
"""

from __future__ import annotations

from typing import Sequence

import simpy

from sim.core.batch import Batch, Idle, StepResult
from sim.core.policy import PolicyError
from sim.cost.profile import Profile
from sim.loop.server import Server


class DpGroup:
    """The lockstep loop of ``servers`` (one a data-parallel rank, none running its own loop:
    ``Server(start=False)``), priced by ``profile`` (the ranks')."""

    def __init__(self, env: simpy.Environment, servers: Sequence[Server], profile: Profile,
                 graph_tokens: int = 0, expert_imbalance: float = 1.0, pads_prefill: bool = True) -> None:
        self.env, self.servers, self.profile = env, list(servers), profile
        self.graph_tokens, self.expert_imbalance = graph_tokens, expert_imbalance
        self.pads_prefill = pads_prefill          # rule 3: False pads decode-only steps only (SGLang)
        self.num_steps = 0
        self.num_dummy_steps = 0          # a rank's steps with nothing of its own (rule 3)
        self.process = env.process(self._serve())
        for s in self.servers:
            s.process = self.process          # each rank's loop is the group's

    def _choose(self, now_s: float) -> list[Batch | Idle]:
        decisions = []
        for s in self.servers:
            decision = s.policy.schedule(s.state, now_s)
            if s.on_finish is not None and s.state.finished_ids:
                s.on_finish(now_s, s.state.take_finished_ids())          # cut short when choosing
            if type(decision) is not Idle and not isinstance(decision, Batch):
                raise s._not_a_batch(decision, now_s)
            if isinstance(decision, Batch) and not decision.items:
                raise PolicyError(f"policy {type(s.policy).__name__} returned an empty Batch at t={now_s:.9g} s "
                                  f"on data-parallel rank {s.replica}; return Idle when nothing can run")
            decisions.append(decision)
        return decisions

    def _serve(self):  # SimPy process
        env, servers = self.env, self.servers
        for s in servers:
            if s.on_finish is not None:
                s.state.finished_ids = []
        now_s = env.now
        while True:
            decisions = self._choose(now_s)
            batches = [d if isinstance(d, Batch) else None for d in decisions]
            if all(b is None for b in batches):
                if all(s.state.done for s in servers):
                    return
                woken = env.event()
                for s in servers:
                    s._wake = woken
                deadlines = [d.wake_at_s for d in decisions if d.wake_at_s is not None]
                if deadlines:
                    yield env.any_of([woken, env.timeout(max(0.0, min(deadlines) - env.now))])
                else:
                    yield woken
                for s in servers:
                    s._wake = None
                now_s = env.now
                continue
            start_s = now_s
            graph_tokens = self.graph_tokens
            if not self.pads_prefill and any(b is not None and (b.num_prefill_seqs or s.state.prefill_items(b))
                                             for s, b in zip(servers, batches)):
                graph_tokens = 0                  # an extend step: every rank its own tokens (SUM_LEN)
            duration_s = self.profile.dp_step_time_s(batches, graph_tokens, self.expert_imbalance)
            yield env.timeout(duration_s)
            end_s = now_s = env.now
            self.num_steps += 1
            result = StepResult(duration_s=duration_s, predicted_s=duration_s)
            for s, batch in zip(servers, batches):
                if batch is None:
                    self.num_dummy_steps += 1
                    continue
                state = s.state
                s.log.record(start_s, batch, result, len(state.waiting), len(state.running),
                             state.kv.num_used_blocks, state.prefill_items(batch))
                state.commit(batch, end_s)
                if s.on_step is not None:
                    s.on_step(start_s, batch, result)
                if s.on_finish is not None and state.finished_ids:
                    s.on_finish(end_s, state.take_finished_ids())
                if s.cache_samples is not None:
                    s._sample_cache(end_s)
