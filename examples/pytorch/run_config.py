"""The run config (configs/*.toml) as the examples read it: the file, then "section.key=value"
overrides, on top of the defaults of core/config/run_config.h.

Only the sections a Python learner uses ([run], [model], [train], [data]) get defaults and type
checks here; the others ([diloco], [codec], [merger], [cluster]) are passed through as they are,
for the run's processes to read. The file must stay readable by the C++ binaries, which reject
unknown sections and keys, so this reader rejects them too.
"""
from __future__ import annotations

import copy
import tomllib
from collections.abc import Sequence
from pathlib import Path

# The defaults of core/config/run_config.h for the sections read here.
DEFAULTS: dict[str, dict] = {
    "run": {"id": "dev", "seed": 1},
    "model": {"layers": 2, "width": 64, "heads": 4, "context": 64},
    "train": {"batch": 16, "lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 50, "total_steps": 2000,
              "eval_every": 100, "eval_batches": 8, "grad_clip": 1.0},
    "data": {"path": "data/kjv.txt", "split": "iid", "heldout_fraction": 0.05},
}
PASSED_THROUGH = ("diloco", "codec", "merger", "cluster")


def _apply(config: dict, table: dict, origin: str) -> None:
    """Merges a parsed TOML table into `config`, checking names and types against DEFAULTS."""
    for section, values in table.items():
        if section not in DEFAULTS and section not in PASSED_THROUGH:
            known = ", ".join(f"[{s}]" for s in (*DEFAULTS, *PASSED_THROUGH))
            raise ValueError(f"{origin}: {section}: unknown section (known: {known})")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: {section}: must be a section ([{section}]), not a value")
        for key, value in values.items():
            if section in DEFAULTS:
                if key not in DEFAULTS[section]:
                    raise ValueError(f"{origin}: {section}.{key}: unknown key")
                default = DEFAULTS[section][key]
                # As in C++: an integer is accepted where a number is expected ("lr = 1").
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      if isinstance(default, float) else
                      type(value) is type(default))
                if not ok:
                    raise ValueError(f"{origin}: {section}.{key}: expected {type(default).__name__}, "
                                     f"got {type(value).__name__} {value!r}")
                if isinstance(default, float):
                    value = float(value)
            config.setdefault(section, {})[key] = value


def parse_override(assignment: str) -> dict:
    """"section.key=value" as a one-key TOML table. The value is read as TOML (3e-4, true, "x");
    if it is not valid TOML it is taken as a bare string, so data.split=region works unquoted."""
    section, dot, rest = assignment.partition(".")
    key, eq, value = rest.partition("=")
    if not dot or not eq or "=" in section or "\n" in assignment:
        raise ValueError(f"override '{assignment}': expected section.key=value")
    header = f"[{section}]\n{key} = "
    try:
        return tomllib.loads(header + value)
    except tomllib.TOMLDecodeError:
        quoted = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        try:
            return tomllib.loads(header + quoted)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"override '{assignment}': {e}") from None


def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """The config as {section: {key: value}}, every key of DEFAULTS present. Raises OSError if the
    file cannot be read, ValueError for syntax errors, unknown names, wrong types or bad values."""
    config = copy.deepcopy(DEFAULTS)
    with open(path, "rb") as f:
        try:
            table = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    _apply(config, table, str(path))
    for assignment in overrides:
        _apply(config, parse_override(assignment), f"override '{assignment}'")
    config["source"] = " + ".join([str(path), *overrides])
    _validate(config)
    return config


def _validate(config: dict) -> None:
    """The ranges of core/config/run_config.cc that the Python learner depends on."""
    model, train, data = config["model"], config["train"], config["data"]
    checks = [
        (all(model[k] >= 1 for k in ("layers", "width", "heads", "context")),
         "model.layers, width, heads and context must be at least 1"),
        (model["width"] % model["heads"] == 0,
         f"model.width ({model['width']}) must be a multiple of model.heads ({model['heads']})"),
        (train["batch"] >= 1 and train["total_steps"] >= 1 and train["eval_batches"] >= 1,
         "train.batch, total_steps and eval_batches must be at least 1"),
        (train["lr"] > 0, "train.lr must be positive"),
        (0 <= train["warmup_steps"] <= train["total_steps"],
         f"train.warmup_steps ({train['warmup_steps']}) must be in [0, train.total_steps ({train['total_steps']})]"),
        (train["weight_decay"] >= 0 and train["grad_clip"] >= 0 and train["eval_every"] >= 0,
         "train.weight_decay, grad_clip and eval_every must not be negative"),
        (data["split"] in ("iid", "region"), f"data.split must be iid or region, not '{data['split']}'"),
        (0 < data["heldout_fraction"] <= 0.5, "data.heldout_fraction must be in (0, 0.5]"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"{config['source']}: {message}")
