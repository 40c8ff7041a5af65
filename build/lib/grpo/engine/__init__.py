"""Training: the GRPO loop (loop) and its steps (sampling, scoring, reference, update,
rollout_metrics, run_files), SFT (sft), and the DeepSpeed plumbing (distributed,
deepspeed_setup, schedules, checkpoint). The only package besides grpo.launch that imports
DeepSpeed."""
