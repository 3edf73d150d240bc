"""matplotlib (an optional extra) for the PNGs the programs write, without a display."""

from __future__ import annotations


def pyplot(what: str, quiet: bool = False):
    """``matplotlib.pyplot`` on the Agg backend, or None (with a line saying ``what`` is not
    written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not quiet:
            print(f"matplotlib is not installed; no {what} (pip install 'moara-jax[plot]')")
        return None
    return plt
