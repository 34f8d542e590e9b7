"""The figure of a kernel profile (``sim calibrate --kernels``): step cost against the
step's tokens, for a prefill of one prompt and for decodes at several contexts, the
kernel profile (solid) beside the analytic roofline of the same model and GPU (dashed)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from reports.presentation.plots import FIG_WIDTH_IN, legend_outside, plain_log_ticks, series_style, set_titles
from sim.core.batch import Batch, BatchItem
from sim.cost.profile import Profile

DECODE_CONTEXTS = (1024, 8192, 32768)


def _prefill_ms(p: Profile, tokens: int) -> float:
    return 1e3 * p.step_time_s(Batch((BatchItem(0, tokens, 0),)))


def _decode_ms(p: Profile, seqs: int, context: int) -> float:
    return 1e3 * p.step_time_s(Batch.of_decodes([BatchItem(i, 1, context) for i in range(seqs)], seqs * context))


def step_cost_figure(kernel: Profile, analytic: Profile | None) -> Figure:
    """Step cost (ms, log) against the step's tokens (log): one prompt of T tokens, and T
    decodes at each of ``DECODE_CONTEXTS``, for ``kernel`` and ``analytic``."""
    fig, ax = plt.subplots(1, 1, figsize=(FIG_WIDTH_IN, 5.6), layout="constrained")
    prefill_tokens = [t for t in (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
                      if t <= kernel.model.max_position_embeddings]
    decode_seqs = [1, 4, 16, 64, 128, 256, 512, 1024]
    series = [("prefill, one prompt", prefill_tokens, lambda p, t: _prefill_ms(p, t))]
    series += [(f"decode at context {c:,}", decode_seqs, lambda p, n, c=c: _decode_ms(p, n, c))
               for c in DECODE_CONTEXTS if c < kernel.model.max_position_embeddings]
    for i, (label, xs, cost) in enumerate(series):
        style = series_style(i)
        ax.plot(xs, [cost(kernel, x) for x in xs], label=f"{label}: kernels", color=style["color"],
                marker=style["marker"], linestyle="-")
        if analytic is not None:
            ax.plot(xs, [cost(analytic, x) for x in xs], label=f"{label}: analytic roofline", color=style["color"],
                    marker=style["marker"], linestyle="--", alpha=0.6, markerfacecolor="none")
        kernel.reset_counters()
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the step (a prompt's length, or the number of decodes)")
    ax.set_ylabel("step time (ms)")
    ax.grid(True, which="major", alpha=0.3)
    prov = kernel.provenance
    set_titles(fig, f"Step cost of {prov.get('model', kernel.model.name)} on {kernel.device} "
                    f"(TP {kernel.tensor_parallel}): measured kernels vs the analytic roofline",
               f"{prov.get('label', '')}; host time per step {1e3 * kernel.overhead_s:.2f} ms "
               f"({prov.get('host', {}).get('engine', '?')} host terms)")
    legend_outside(fig, ncol=2)
    plain_log_ticks(fig)
    return fig
