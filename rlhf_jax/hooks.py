"""The run loop's hooks: what happens between two training steps, each with an `every`.

    loop = HookList()
    loop.add(checkpoint, every=cfg.trainer.save_freq, at_end=True)
    ...
    state = loop.run(state, info)      # after each step, in the order they were added

A hook is `fn(state: RunState, info: StepInfo) -> RunState`: it reads the step's metrics
from `info`, may add to them (validation), end the step early (a rollback sets
`info.rolled_back` and the later hooks are skipped) or ask the run to stop (`info.stop`), and
returns the run state, replaced where it acts on it (a rollback restores an older one).
(levanter's `Trainer.add_hook(fn, every=n)` in spirit.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class StepInfo:
    """What the hooks of one step see and say."""

    step: int
    metrics: dict
    final: bool  # the last step of the run
    stop: bool = False  # a hook ends the run after this step
    rolled_back: bool = False  # a hook undid this step: the later hooks do not run


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn` after every `every`-th step (0 or less: never), and after the last one (the
    run's end or an early stop) when `at_end`."""

    name: str
    fn: Callable[[Any, StepInfo], Any]
    every: int = 1
    at_end: bool = False

    def due(self, info: StepInfo) -> bool:
        if self.every > 0 and info.step % self.every == 0:
            return True
        return self.at_end and (info.final or info.stop)


class HookList:
    """Hooks in the order they run after each step."""

    def __init__(self):
        self.hooks: list[Hook] = []

    def add(self, name: str, fn, *, every: int = 1, at_end: bool = False) -> None:
        self.hooks.append(Hook(name, fn, every, at_end))

    def run(self, state, info: StepInfo):
        for hook in self.hooks:
            if info.rolled_back:
                break
            if hook.due(info):
                state = hook.fn(state, info)
        return state

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hooks]
