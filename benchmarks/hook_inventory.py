"""Check every vLLM attribute the plugin hooks (``vllm_compat.HOOKS``) against the vLLM on this path.

``python -m benchmarks.hook_inventory`` prints one line per hook (``ok`` or why it cannot be hooked)
and the vLLM version, and exits 1 if a required hook is unusable: the check behind "every touch of
vLLM internals is checked against both 0.25 and 0.32" (the CPU build's tests cover 0.32).
"""

from __future__ import annotations

import sys


def main() -> int:
    from vllm_powersave import vllm_compat

    print(f"vLLM {vllm_compat.vllm_version()}")
    usable: dict[tuple[str, str], bool] = {}  # (feature, group): some alternative can be hooked
    for h in vllm_compat.HOOKS:
        why = vllm_compat.hook_problem(h)
        optional_absent = why is not None and h.optional and "does not import" in why
        key = (h.feature, h.group or h.attr)
        usable[key] = usable.get(key, False) or why is None or optional_absent
        print(
            f"{'ok  ' if why is None else ('skip' if optional_absent else 'no  ')} {h.feature:10s} {h.name}" + (f": {why}" if why else "")
        )
    bad = [f"{f}:{g}" for (f, g), ok in usable.items() if not ok]
    print("FAIL: " + ", ".join(bad) if bad else "every feature has a usable hook")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
