"""Reading a training config: a preset, then a TOML/YAML/JSON file, then `--set key=value`
overrides; and writing one back as TOML (--print-config).

Precedence, lowest first: the preset (a model preset such as "small", or a training preset such as
"h200-curriculum") < the config file < `--set`. Model settings start from the preset's
`ModelConfig` and are overridden field by field; a config file's `stages` list replaces the
preset's, while `--set stages.0.steps=10` edits one field (and `stages.N.x=...` with N = the number
of stages appends a stage). A model preset whose vocabulary has fewer ids than data.tokenizer (tiny:
97 < the byte tokenizer's 256) gets the tokenizer's, unless the file or `--set` gives model.vocab_size.
Every mistake is a `ConfigError` whose one sentence names the setting and the fix; nothing else escapes.
"""

from __future__ import annotations

import json
import math
import re
import typing
from pathlib import Path

from ..errors import ConfigError
from .model import PRESETS as MODEL_PRESETS, ModelConfig
from .parallel import ParallelConfig
from .train import DataConfig, RLConfig, SFTConfig, Stage, TrainConfig, _check_keys, _short, base_config


def load_train_config(config_file: str | None = None, preset: str | None = None, sets: list[str] | tuple = ()) -> TrainConfig:
    """The config from a preset, an optional TOML/YAML/JSON file and `--set key=value` overrides."""
    raw = _read_config_file(config_file) if config_file else {}
    _check_keys(raw, "")
    pairs = [_split_set(s) for s in sets]
    name = raw.pop("preset", None)
    if preset is not None:
        name = preset
    for k, v in pairs:
        if k == "preset":
            name = v
    name = "small" if name is None else name
    d = base_config(name).to_dict()
    if name in MODEL_PRESETS:  # sized to data.tokenizer as resolved below, unless the file or --set gives it
        del d["model"]["vocab_size"]
    _merge(d, raw)
    d["preset"] = name
    for k, v in pairs:
        if k != "preset":
            _assign(d, k, v)
    cfg = TrainConfig.from_dict(d)
    cfg.model_given = _model_given(raw, pairs)  # what init_from lays over the checkpoint's model
    return cfg


def _model_given(raw: dict, pairs: list) -> frozenset:
    """The model settings the file and `--set` name (not those the preset filled in)."""
    given = set(raw["model"]) if isinstance(raw.get("model"), dict) else set()
    for k, v in pairs:
        if k == "model" and isinstance(v, dict):
            given |= set(v)
        elif k.startswith("model."):
            given.add(k.split(".")[1])
    return frozenset(given)


def _read_config_file(path: str) -> dict:
    try:
        p = Path(path).expanduser()
    except RuntimeError:
        raise ConfigError(f"config file {path!r} starts with the home folder of a user this machine does not have; "
                          "write the path out in full.") from None
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass the path of a .toml, .yaml or .json file to --config.")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"config file '{path}' must end in .toml, .yaml, .yml or .json; rename it to say its format.")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"config file '{path}' could not be read as UTF-8 text ({e}); save it as UTF-8.") from e
    if suffix == ".toml":
        toml = _tomllib()
        if toml is None:
            raise ConfigError(f"config file '{path}' is TOML, which needs the tomli package on Python 3.10; `pip install tomli` or write it as YAML.")
        try:
            data = toml.loads(text)
        except Exception as e:  # TOMLDecodeError says "(at line L, column C)"
            raise ConfigError(f"config file '{path}' is not valid TOML ({e}); fix the syntax there.") from e
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid JSON (line {e.lineno}: {e.msg}); fix the syntax there.") from e
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except Exception as e:  # YAMLError, or a Python error from an odd construct
            mark = getattr(e, "problem_mark", None)
            at = f"line {mark.line + 1}: " if mark is not None else ""
            what = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"config file '{path}' is not valid YAML ({at}{what}); fix the syntax there.") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a table of settings at the top (got {type(data).__name__}); see --print-config.")
    return data


def _tomllib():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            return None
    return tomllib


def _split_set(s) -> tuple[str, object]:
    if not isinstance(s, str) or "=" not in s or not s.split("=", 1)[0].strip():
        raise ConfigError(f"--set {_short(s)} is not key=value; write it like --set model.hidden_size=256.")
    key, text = s.split("=", 1)
    key = key.strip()
    return key, (_coerce_str(key, text, _parse_value(text)))


def _parse_value(text: str):
    """A TOML scalar/array/inline table, else null, else a plain number, else the text itself."""
    t = text.strip()
    toml = _tomllib()
    if toml is not None:
        try:
            parsed = toml.loads(f"v = {t}")
            if list(parsed) == ["v"]:  # not "1\nx = 2" smuggling in a second key
                return parsed["v"]
        except Exception:
            pass
    if t.lower() in ("null", "none", "~"):
        return None
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", t):
        return float(t) if re.search(r"[.eE]", t) else int(t)
    if toml is None:  # Python 3.10 without tomli: YAML flow syntax for true/false and [lists]
        import yaml

        try:
            v = yaml.safe_load(t)
            if isinstance(v, (bool, list, dict)):
                return v
        except Exception:
            pass
    return t


def _coerce_str(key: str, text: str, value):
    """For a text setting (a path, a name), keep what was typed: data.path=2024 means the folder "2024"."""
    tp = _field_type(key.split("."))
    if tp is not None and value is not None and not isinstance(value, str):
        args = typing.get_args(tp) or (tp,)
        if typing.get_origin(tp) not in (list, dict) and str in args and all(a in (str, type(None)) for a in args):
            return text.strip()
    return value


def _field_type(parts: list[str]):
    """The annotation of the setting a dotted --set key names, or None when it names no field."""
    cls, i = TrainConfig, 0
    while True:
        hints = typing.get_type_hints(cls)
        if parts[i] not in hints:
            return None
        if i == len(parts) - 1:
            return hints[parts[i]]
        if cls is TrainConfig and parts[i] in ("model", "data", "parallel", "sft", "rl"):
            cls, i = {"model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig, "sft": SFTConfig,
                      "rl": RLConfig}[parts[i]], i + 1
        elif cls is TrainConfig and parts[i] == "stages" and parts[i + 1].isdigit() and i + 2 < len(parts):
            cls, i = Stage, i + 2
        elif cls is DataConfig and parts[i] == "sources" and i + 2 == len(parts):
            return str
        else:
            return None


def _merge(base: dict, over: dict) -> None:
    """Tables merge key by key; lists (stages) and values replace."""
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def _assign(d: dict, key: str, value) -> None:
    parts = key.split(".")
    if any(not p.strip() for p in parts):
        raise ConfigError(f"--set {key!r} has an empty name part; write dotted names like model.hidden_size=256.")
    node, path = d, []
    for p in parts[:-1]:
        path.append(p)
        if isinstance(node, dict):
            if not isinstance(node.get(p), (dict, list)):
                if p in node and node[p] is not None:
                    raise ConfigError(f"{'.'.join(path)} is a single value, not a table; use --set {'.'.join(path)}=VALUE.")
                node[p] = {}
            node = node[p]
        else:
            idx = _index(node, p, path, key)
            if idx == len(node):
                node.append({})
            node = node[idx]
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"{'.'.join(path)} is a single value, not a table; use --set {'.'.join(path)}=VALUE.")
    last = parts[-1]
    if isinstance(node, dict):
        node[last] = value
    else:
        idx = _index(node, last, [*path, last], key)
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value


def _index(node: list, p: str, path: list[str], key: str) -> int:
    where = ".".join(path[:-1])
    if not p.isdigit():
        raise ConfigError(f"--set {key}: {where} is a list, so the next part must be an index 0..{len(node)} (got {p!r}).")
    idx = int(p)
    if idx > len(node):
        raise ConfigError(
            f"--set {key}: {where} has {len(node)} entries ({where}.0 .. {where}.{len(node) - 1}); "
            f"use one of those, or {where}.{len(node)} to add one."
        )
    return idx


# ------------------------------------------------------------------------------ TOML writer
def to_toml(cfg: TrainConfig) -> str:
    """A TOML rendering for --print-config; it loads back with --config (TOML has no null,
    so unset values appear as comments)."""
    d = cfg.to_dict()
    lines = [f"# longctx training config: {cfg.summary()}"]
    if cfg.vocab_note:
        lines.append(f"# {cfg.vocab_note}")
    tables = ("model", "data", "sft", "rl", "kernels", "parallel", "stages")
    lines += _toml_items({k: v for k, v in d.items() if k not in tables})
    for t in ("model", "data", "sft", "rl", "kernels", "parallel"):
        lines += ["", f"[{t}]", *_toml_items(d[t])]
    for s in d["stages"]:
        lines += ["", "[[stages]]", *_toml_items(s)]
    return "\n".join(lines) + "\n"


_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE.match(k) else _toml_str(k)


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        items = [f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    return _toml_str(str(v))


def _toml_items(d: dict) -> list[str]:
    return [f"# {_toml_key(k)} = (unset)" if v is None else f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d.items()]
