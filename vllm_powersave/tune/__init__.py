"""The tuner behind ``vllm-powersave tune``: from a kernel-level profile to a preset file.

Modules (each importable on its own; ``lmhead`` and ``energy`` need only torch and, on a GPU,
nvidia-ml-py, so that the LM-head grid runs on a bare GPU machine, as for the H200 records
``docs/results/h200-lmhead-chunking*.md``; ``vllm-powersave tune MODEL --only chunking`` runs it):

* :mod:`.energy` -- NVML energy windows aligned to the counter's 100 ms updates (measured), and the
  simulated H200 costing of a piece of work (simulated);
* :mod:`.lmhead` -- LM-head time and energy per chunk count over a grid of row counts;
* :mod:`.profile` -- prefill/decode/mixed steps of a model's modules with vLLM-equal shapes under
  ``torch.profiler``, grouped by kernel kind, with arithmetic intensity and a bound label;
* :mod:`.solver` -- the clock-response model and the minimal-energy solver under a slowdown budget
  (per phase, local and global across kernel groups), with the re-measurement guard of seed 000;
* :mod:`.run` -- the ``tune`` command: orchestration, preset file, Markdown + PNG report.
"""
