"""Orbax checkpoints: train state (params, optimizer state with bases and counters, step) and
the data iterator state, every N steps, keeping K, written atomically by orbax."""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: pathlib.Path, keep: int, every: int):
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(directory.resolve(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, force: bool = False) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
            force=force,
        )

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def restore(self, step: int, abstract_state):
        """``abstract_state``: ``jax.ShapeDtypeStruct``s with the target shardings."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
        return out.state, out.data

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
