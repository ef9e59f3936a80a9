"""The monitor's part of a training checkpoint: what ``GradMonitor.state_dict`` saves
(``monitor_state``) and how ``load_state_dict`` checks and restores it (``restore_state``): the
next step number, the counters, and the state of a ``ZClip``, of the dynamics and of the flight
recorder.

Layer: monitor. Imports ``gradfuse.clip`` and the monitor's recorder hooks.
"""
from __future__ import annotations

from gradfuse.clip.zclip import ZClip
from gradfuse.monitor import recorder_hooks as flight

# The version of the state dict written; a monitor refuses a state of a newer one.
STATE_VERSION = 1
# The monitor's counters kept as ints on the host (clipped_steps is a device counter; see GradMonitor).
COUNTERS = ("skipped_steps", "anomaly_steps", "nonfinite_steps", "explode_steps", "amp_overflow_steps")


def monitor_state(monitor) -> dict:
    """``monitor.state_dict()``: ``version``, ``step``, ``clipped_steps`` (reads the device
    counter), the ``COUNTERS``, and ``zclip``, ``dynamics`` and the recorder's state where the
    monitor has them."""
    state = {"version": STATE_VERSION, "step": monitor.step_count, "clipped_steps": monitor.clipped_steps}
    state.update({name: getattr(monitor, name) for name in COUNTERS})
    if isinstance(monitor.max_norm, ZClip):
        state["zclip"] = monitor.max_norm.state_dict()
    if monitor.dynamics is not None:
        state["dynamics"] = monitor.dynamics.state_dict()
    return {**state, **flight.recorder_state(monitor)}


def restore_state(monitor, state: dict) -> None:
    """Restores what ``monitor_state`` saved, but the clipped-steps counter (the monitor's own).

    Raises:
        KeyError: ``state`` lacks ``step``, ``clipped_steps`` or one of the counters (nothing
            is restored then).
        ValueError: ``state`` was saved by a newer gradfuse (nothing is restored then); from the
            ``ZClip`` state when its ``warmup_steps`` differs; from a malformed noise scale state.
    """
    missing = {"step", "clipped_steps", *COUNTERS} - set(state)
    if missing:
        raise KeyError(f"gradfuse.GradMonitor.load_state_dict: missing {sorted(missing)}")
    if state.get("version", STATE_VERSION) > STATE_VERSION:
        raise ValueError(f"gradfuse.GradMonitor.load_state_dict: state version {state['version']} "
                         f"is newer than this gradfuse understands ({STATE_VERSION})")
    monitor.step_count = int(state["step"])
    for name in COUNTERS:
        setattr(monitor, name, int(state[name]))
    if monitor.dynamics is not None and "dynamics" in state:
        monitor.dynamics.load_state_dict(state["dynamics"])
    if isinstance(monitor.max_norm, ZClip) and "zclip" in state:
        monitor.max_norm.load_state_dict(state["zclip"])
    flight.load_recorder_state(monitor, state)
