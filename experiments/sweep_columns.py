"""The columns of a sweep's results table (results.csv, results.md): the run's name and
status, the config keys a point can vary, what each run measured, and its error."""

CONFIG_COLUMNS = (
    "nproc",
    "tp",
    "pp",
    "dp",
    "ep",
    "cp",
    "cp_mode",
    "seq_len",
    "zero",
    "schedule",
    "virtual_stages",
    "micro_batches",
    "micro_batch_size",
    "precision",
    "recompute",
    "sequence_parallel",
    "grad_sync",
    "moe_experts",
    "moe_top_k",
)
RESULT_COLUMNS = (
    "tokens_per_s",
    "tokens_per_s_spread",
    "tflops_per_device",
    "mfu",
    "mem_per_rank_bytes",
    "mem_model_states_bytes",
    "mem_params_bytes",
    "mem_grads_bytes",
    "mem_master_and_optimizer_bytes",
    "mem_activations_bytes",
    "mem_grads_peak_bytes",
    "mem_peak_bytes",
    "comm_tp_bytes",
    "comm_pp_bytes",
    "comm_dp_bytes",
    "comm_ep_bytes",
    "comm_cp_bytes",
    "comm_total_bytes",
    "model_states_predicted_error",
    "final_loss",
    "final_loss_mean",
    "wall_time_s",
)
COLUMNS = ("name", "status", *CONFIG_COLUMNS, *RESULT_COLUMNS, "error")
# the columns of bytes per step (comm_<column>_bytes) and the process groups each sums: the
# all-to-all of expert parallelism runs on "ep"; data-parallel reductions over dp × cp on
# "dp_cp"; context parallelism's ring and all-to-all on "cp" (a hybrid's on its two subgroups)
COMM_GROUPS = {
    "tp": ("tp",),
    "pp": ("pp",),
    "dp": ("dp", "dp_cp"),
    "ep": ("ep",),
    "cp": ("cp", "cp_a2a", "cp_ring"),
}
