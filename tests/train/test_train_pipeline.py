"""Trainer.iter_steps: the next step is queued before a step's metrics are read, except where fit evaluates or
saves; the losses are the ones train_step gives one step at a time."""

from flash_models.train import Trainer


def test_pipelined_steps_equal_one_at_a_time_and_wait_at_eval_and_save_steps(tiny_config, tmp_path):
    cfg = dict(train={"max_steps": 6, "eval_every": 0, "save_every": 4, "output_dir": str(tmp_path / "a")})
    one_at_a_time = Trainer(tiny_config(**cfg))
    expected = [one_at_a_time.train_step() for _ in range(6)]

    pipelined = Trainer(tiny_config(**{"train": {**cfg["train"], "output_dir": str(tmp_path / "b")}}))
    ahead = []
    records = []
    for record in pipelined.iter_steps(6):
        ahead.append(pipelined.step - record["step"])  # 1: the next step was queued before this record was read
        assert record.pop("seconds") > 0
        records.append(record)
    assert [r["step"] for r in records] == list(range(1, 7))
    for got, want in zip(records, expected):
        assert got == want
    # Step 4 saves (save_every=4): the model must be as step 4 left it, so step 5 waits; step 6 is the last.
    assert ahead == [1, 1, 1, 0, 1, 0]


def test_on_the_cpu_each_record_times_its_own_step(tiny_config, monkeypatch):
    """Queuing a step on the CPU runs it, and the next step is queued before a record is read: each record took
    the next step's time, and the last one almost none (tokens/s in the millions in the progress bar)."""
    import time

    trainer = Trainer(tiny_config(train={"max_steps": 3}))
    queue = trainer._queue_step

    def slow_second_step():
        if trainer.step == 1:
            time.sleep(0.3)
        return queue()

    monkeypatch.setattr(trainer, "_queue_step", slow_second_step)
    seconds = [record["seconds"] for record in trainer.iter_steps(3)]
    assert seconds[1] >= 0.3 and seconds[0] < 0.25 and seconds[2] < 0.25, seconds
