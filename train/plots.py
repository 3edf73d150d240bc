"""matplotlib (an optional extra) for the PNGs the programs write, without a display."""

from __future__ import annotations


def figure(what: str, **kwargs):
    """A ``matplotlib.figure.Figure`` (``kwargs`` are its own, e.g. ``figsize``; constrained
    layout), or None (with a line saying ``what`` is not written) when matplotlib is not installed.

    Not pyplot's: a figure of its own leaves the process's backend and pyplot's list of figures as
    they were (a notebook that runs the trainer or a sweep keeps its inline plots) and needs no
    closing. ``savefig`` renders it with the Agg canvas.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed; no {what} (pip install 'moara-jax[plot]')")
        return None
    return Figure(layout="constrained", **kwargs)
