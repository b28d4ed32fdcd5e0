"""`dlenv watch -- COMMAND ...`: the GPU watched for any training command, with a record and advice.

The command (your own `python train.py`, a notebook's kernel, `dlenv train` itself) runs unchanged in a
session and process group of its own; SIGINT, SIGTERM, SIGHUP (and every other signal it can catch) sent
to `dlenv watch` are passed on to that whole group (as a terminal's Ctrl-C reaches every process of its
foreground group: the script and its DataLoader workers), and its exit status is passed back (a signal n
as 128+n). Every ~1 s it samples each visible GPU through NVML (NVIDIA's own nvidia-ml-py: utilisation,
memory used, power and its limit, SM clock and its maximum; nvitop and nvidia-smi read the same counters)
and the host from /proc (the CPUs the command may run on, the command's processes' CPU and resident
memory, disk reads).

The record goes to runs/watch/<name>/ (exp, exp2, ... as train's runs): watch.csv (one row per sample,
written as it is taken, so a kill leaves what was seen), watch.png (the timeline) and watch.md: one
paragraph (GPU busy X% of the time, the card's memory peak, power at full utilisation) and what the
pattern suggests, each line with the dlenv option or own-loop part that addresses it (`advise`, a pure
function of the samples; docs/watch.md says what each line means). Without NVML or a GPU it says so in
one line and still runs the command and records the host.

The command never outlives the watcher: every catchable signal is passed on (handlers in place before it
starts), PR_SET_PDEATHSIG ends it if the watcher is killed, and a keeper ends the rest of its group (`leash`).

The wing: run (the command run and watched: `main`, `watch`), leash (the command tied to the watcher's
life), probes (NVML and /proc; `GpuBusy`, which
`dlenv train` uses for the per-epoch gpu_busy column of results.csv), advice (a pure function of the
samples, and the paragraph), record (watch.csv, watch.png).

No torch here: the watcher must not take the GPU memory or start-up seconds of the command it watches.
"""
