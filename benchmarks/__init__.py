"""Benchmarks: one script per question, each `python -m benchmarks.<name> --out DIR` on your GPU.

  selection   block-selection time against N: PISA, our BSA, fla's BSA
  attention   selected-block attention forward and forward + backward: ours, fla, cuDNN dense;
              random, PISA or real-model indices
  dump_qk     a helper, not a benchmark: post-RoPE q/k of a trained run for `attention
              --indices real`
  packed      packed documents (segment_ids) against one sequence: selection and attention,
              ours and fla's varlen NSA
  layer       the whole PISA layer (selection + attention, forward + backward) against cuDNN dense
  training    tokens/s of the `small` preset, dense against PISA attention
  multi_gpu   the `small` preset over the local GPUs: scaling, memory, equivalence, restores
  replication the paper's Tables 2, 3, 6 and 7 in miniature: every attention kind trained on the
              same data (one run a process), evaluated by pisa-eval; results/replication/

Each writes results/<name>.json (the layout of `_record.py`: commit, jax, device, date, settings,
rows) and results/<name>.png; `--replot JSON` redraws a plot anywhere. run_all.sh runs them all.
"""
