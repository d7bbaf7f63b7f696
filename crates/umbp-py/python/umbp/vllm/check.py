"""``python -m umbp.vllm.check CONFIG.json``: runs a connector configuration on CPU, no GPU.

CONFIG.json is either the ``kv_connector_extra_config`` object given to vLLM (``{"ssd_path":
..., "load_mode": ...}``) or a whole ``kv_transfer_config`` (an object with
``"kv_connector"`` or ``"kv_connector_extra_config"``: then ``kv_connector`` must be
``UmbpConnector`` from ``umbp.vllm``, and its ``kv_role`` and other fields are vLLM's, checked
by vLLM). The configuration runs through vLLM's own scheduler and the connector's worker side
over CPU tensors, with a toy model (4 layers, 2 KV heads of 16, blocks of 16 tokens: 8 KiB a
block), as ``umbp.vllm._harness`` drives them in the tests:

1. the first pass prefills ``--requests`` prompts one after another, each ``--prefix-blocks``
   shared blocks then 2 blocks and 3 tokens of its own: the shared blocks are computed once
   (vLLM's prefix cache serves the repeats) and every full block is saved;
2. vLLM's prefix cache is reset, and the second pass sends as many new prompts, one after
   another, each the shared blocks then a new tail, vLLM's prefix cache reset before each: every
   shared block must come from the connector, so the second pass should hit exactly
   ``requests x prefix-blocks`` blocks; every loaded byte is compared with what its prefix
   implies.

It prints the hits (tokens and blocks), the bytes verified, and where blocks went (saved to
and loaded from DRAM, SSD or a memory node, demoted, and which index: in-process or the pool).
The tiers are capped at ``--max-tier-bytes`` each (the toy blocks need little), and SSD files
and an embedded pool are made in a temporary directory (``--ssd-dir``: in that directory
instead, to try its filesystem), so a running server's files are never touched; a Redis pool
is joined as given (the check's toy blocks carry their own namespace).

Exit status: 0 when every shared block hit (for ``kv_both``) and every byte loaded was right;
1 when a load brought wrong bytes, a load failed or the hits fell short (the lines above say
which); 2 when the configuration does not start, with the connector's (or vLLM's) own error
message, naming the key.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .config import UmbpConfig

#: The whole-``kv_transfer_config`` form's markers (vLLM's field names).
_TRANSFER_KEYS = ("kv_connector", "kv_connector_extra_config")
#: The toy model: layers, KV heads and head size (fp16, blocks of 16 tokens).
_LAYERS = 4
#: Tokens of each prompt's own tail beyond its own full blocks.
_TAIL_BLOCKS, _TAIL_TOKENS = 2, 3


class ConfigError(ValueError):
    """The configuration file is not one the connector starts with (the message names the
    key, in the connector's or vLLM's words)."""


def read_config(path: str) -> Tuple[str, Dict[str, Any], Dict[str, Any]]:
    """Reads ``path``: returns (its form, ``"kv_connector_extra_config"`` or
    ``"kv_transfer_config"``; the extra config; vLLM's other ``kv_transfer_config``
    fields). Raises :class:`ConfigError` for a file that is not a JSON object, or a
    ``kv_transfer_config`` that does not load UmbpConnector from ``umbp.vllm``."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a JSON object is needed, not {type(data).__name__}")
    if not any(k in data for k in _TRANSFER_KEYS):
        return "kv_connector_extra_config", data, {}
    fields = dict(data)
    extra = fields.pop("kv_connector_extra_config", None) or {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config must be a JSON object")
    if fields.get("kv_connector") != "UmbpConnector":
        raise ConfigError(
            f"kv_connector is {fields.get('kv_connector')!r}: this checks \"UmbpConnector\""
        )
    if fields.get("kv_connector_module_path", "umbp.vllm") != "umbp.vllm":
        raise ConfigError(
            f"kv_connector_module_path is {fields['kv_connector_module_path']!r}: vLLM loads "
            "UmbpConnector from \"umbp.vllm\""
        )
    fields.pop("kv_connector")
    fields.pop("kv_connector_module_path", None)
    return "kv_transfer_config", extra, fields


def scaled_extra(
    extra: Dict[str, Any], scratch: str, max_tier_bytes: int
) -> Tuple[Dict[str, Any], List[str]]:
    """The extra config the check runs: tiers capped at ``max_tier_bytes``, SSD files and an
    embedded pool's file moved into ``scratch`` (their file names kept). Returns it with a
    line per change."""
    out = dict(extra)
    notes = []
    dram_default = UmbpConfig.dram_bytes_per_rank
    for key, default in (("dram_bytes_per_rank", dram_default), ("ssd_bytes_per_rank", 0)):
        given = int(out.get(key, default))
        if given > max_tier_bytes:
            out[key] = max_tier_bytes
            what = "" if key in extra else " (the default)"
            notes.append(f"{key} {given}{what} capped at {max_tier_bytes} (--max-tier-bytes)")
    for key in ("ssd_path", "pool"):
        value = out.get(key)
        if not isinstance(value, str) or (key == "pool" and value == "embedded" or "://" in value):
            continue
        moved = os.path.join(scratch, os.path.basename(value.rstrip("/")) or "kv")
        out[key] = moved
        notes.append(f"{key} {value!r} moved to {moved!r}")
    return out, notes


def _tiers(stats: Dict[str, float], counter: str) -> Dict[str, int]:
    """``counter``'s per-tier values in the workers' summed stats (``"saved_blocks.dram"``)."""
    prefix = counter + "."
    return {
        k[len(prefix) :]: int(v) for k, v in sorted(stats.items()) if k.startswith(prefix) and v
    }


def _since(now: Dict[str, float], before: Dict[str, float]) -> Dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def _index_kind(cfg: UmbpConfig) -> str:
    if cfg.pool is None:
        return "in-process (umbp.kvtiers.TierIndex)"
    if "://" in cfg.pool:
        return f"the pool in Redis ({cfg.pool.split('@')[-1]})"
    return f"the pool, embedded ({cfg.pool_file()})"


def run(args: argparse.Namespace) -> Tuple[int, Dict[str, Any], List[str]]:
    """Runs the check; returns (exit status, the result, the lines printed)."""
    form, extra, fields = read_config(args.config)
    try:
        UmbpConfig.from_extra(extra)  # the connector's own parse: its message on a bad key
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    from . import _harness

    lines: List[str] = []
    with tempfile.TemporaryDirectory(dir=args.ssd_dir) as scratch:
        run_extra, notes = scaled_extra(extra, scratch, args.max_tier_bytes)
        kv_role = str(fields.pop("kv_role", "kv_both"))
        try:
            h = _harness.PrefixModelHarness(
                scratch,
                layers=_LAYERS,
                num_blocks=args.requests * (args.prefix_blocks + _TAIL_BLOCKS + 2) + 16,
                tp=args.tp,
                kv_role=kv_role,
                transfer=fields,
                **run_extra,
            )
        except Exception as e:  # the connector's or vLLM's refusal, whatever its type
            raise ConfigError(f"{type(e).__name__}: {e}") from None
        try:
            result = _passes(h, args, kv_role)
        except (_harness.WrongBytes, TimeoutError) as e:  # a wrong load, a lost completion
            return 1, {"ok": False, "error": f"{type(e).__name__}: {e}"}, [f"FAILED: {e}"]
        finally:
            h.close()
        cfg = UmbpConfig.from_extra(run_extra)
        result.update(
            form=form,
            kv_role=kv_role,
            load_mode=cfg.load_mode,
            tp=args.tp,
            index=_index_kind(cfg),
            block_tokens=_harness.BS,
            block_bytes=_LAYERS * h.page_bytes,
            adjusted=notes,
        )
    lines.append(
        f"{args.config}: a {form}; kv_role {kv_role}, load_mode {cfg.load_mode}, TP {args.tp}"
    )
    lines.extend(f"  {n}" for n in notes)
    lines.append(
        f"toy model: {_LAYERS} layers, blocks of {_harness.BS} tokens, "
        f"{result['block_bytes']} bytes a block per rank; index: {result['index']}"
    )
    per_rank = " (counted per rank)" if args.tp > 1 else ""
    lines.append(
        f"first pass: {args.requests} prompts, {args.prefix_blocks} shared blocks each: saved "
        f"{sum(result['saved_blocks'].values())} blocks{per_rank}: {_where(result['saved_blocks'])}"
        + (f"; demoted to SSD {result['demoted_blocks']}" if result["demoted_blocks"] else "")
        + (f"; save errors {_where(result['save_errors'])}" if result["save_errors"] else "")
    )
    lines.append(
        f"second pass: hit {result['hit_blocks']} of {result['expected_hit_blocks']} shared "
        f"blocks ({result['hit_tokens']} of {result['expected_hit_blocks'] * _harness.BS} "
        f"tokens), loaded{per_rank} {_where(result['loaded_blocks'])}"
    )
    lines.append(
        f"verified: {result['verified_blocks']} blocks, {result['verified_bytes']} bytes, each as "
        f"its prefix implies; load errors {result['load_errors']}"
    )
    status = 0
    if result["load_errors"]:
        lines.append(f"FAILED: {result['load_errors']} blocks' loads failed (vLLM recomputed them)")
        status = 1
    if not result["hit_blocks"] == result["verified_blocks"] == result["expected_hit_blocks"]:
        lines.append(
            f"FAILED: the second pass hit {result['hit_blocks']} blocks ("
            f"{result['verified_blocks']} loaded whole and verified), not the "
            f"{result['expected_hit_blocks']} shared ones"
        )
        status = 1
    if kv_role != "kv_both":
        does = "only saves" if kv_role == "kv_producer" else "only loads"
        lines.append(f"note: a {kv_role} {does}: no hits are expected from this check")
    if status == 0:
        lines.append("OK")
    result["ok"] = status == 0
    return status, result, lines


def _where(tiers: Dict[str, int]) -> str:
    return ", ".join(f"{n} {t}" for t, n in tiers.items()) or "none"


def _passes(h: Any, args: argparse.Namespace, kv_role: str) -> Dict[str, Any]:
    """The two passes (see the module's docstring); returns their numbers."""
    from ._harness import BS, prompt

    shared = prompt(1, args.prefix_blocks * BS)
    tail = _TAIL_BLOCKS * BS + _TAIL_TOKENS
    for i in range(args.requests):
        h.add(f"save-{i}", shared + prompt(100 + i, tail))
        h.run()
    saved = dict(h.stats)
    expected = args.requests * args.prefix_blocks if kv_role == "kv_both" else 0
    hit_tokens = 0
    for i in range(args.requests):
        if not h.scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM's prefix cache did not reset")
        rid = f"hit-{i}"
        h.add(rid, shared + prompt(200 + i, tail))
        h.run()
        hit_tokens += min(h.first_computed[rid], args.prefix_blocks * BS)
    loaded = _since(h.stats, saved)
    return {
        "requests": args.requests,
        "prefix_blocks": args.prefix_blocks,
        "saved_blocks": _tiers(saved, "saved_blocks"),
        "save_errors": _tiers(h.stats, "save_errors"),
        "demoted_blocks": int(h.stats.get("demoted_blocks.ssd", 0)),
        "expected_hit_blocks": expected,
        "hit_tokens": hit_tokens,
        "hit_blocks": hit_tokens // BS,
        "loaded_blocks": _tiers(loaded, "loaded_blocks"),
        "verified_blocks": h.checked_loads,
        "verified_bytes": h.verified_bytes,
        "load_errors": len(h.load_errors),
    }


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m umbp.vllm.check``."""
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(
        prog="python -m umbp.vllm.check",
        description=doc.split("\n\n", 1)[1] if "\n\n" in doc else doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "config",
        help="a JSON file: the kv_connector_extra_config object, or a whole kv_transfer_config "
        "(an object with \"kv_connector\" or \"kv_connector_extra_config\")",
    )
    ap.add_argument("--requests", type=int, default=4, help="prompts per pass (default 4)")
    ap.add_argument(
        "--prefix-blocks", type=int, default=8, help="blocks the prompts share (default 8)"
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    ap.add_argument(
        "--max-tier-bytes",
        type=int,
        default=64 << 20,
        help="caps dram_bytes_per_rank and ssd_bytes_per_rank (default 64 MiB)",
    )
    ap.add_argument(
        "--ssd-dir",
        default=None,
        help="where the SSD files and an embedded pool go (a temporary directory made in it "
        "and removed after; default: the system's temporary directory)",
    )
    ap.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns its exit status."""
    args = parser().parse_args(argv)
    for name in ("requests", "prefix_blocks", "tp"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    logging.getLogger("vllm").setLevel(logging.WARNING)
    try:
        status, result, lines = run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if args.json:
        print(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
