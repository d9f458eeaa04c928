"""What several stages use, below them all: the process lifecycle (`lifecycle.py`, its watchdog program
`watchdog_main.py`), the adapter as one flat buffer (`adapter.py`), the logit processing the generators apply and
the trainer re-applies (`logits.py`), and the metric names with the JSONL log (`metrics.py`);
`quiet.py` silences a warning before anything imports peft."""
