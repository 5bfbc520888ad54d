"""Weights & Biases as one more destination of the metrics (optional: pip install wandb).

The run's W&B id is kept in <output_dir>/wandb_run_id, so rerunning the command after a stop
or preemption continues the same W&B run (resume="allow"). Every record is logged with
`iteration` as its x axis: after a resume, the iterations between the checkpoint and the
stop are logged again (metrics.jsonl and TensorBoard drop the earlier ones; W&B keeps both).
Offline nodes: WANDB_MODE=offline writes <output_dir>/wandb/offline-run-*, for `wandb sync`.
"""
from __future__ import annotations

import uuid
from pathlib import Path

RUN_ID_FILE = "wandb_run_id"


class WandbSink:
    def __init__(self, run_dir: Path, project: str, entity: str | None, name: str | None, config: dict):
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, entity=entity, name=name or run_dir.resolve().name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config)
        self.run.define_metric("*", step_metric="iteration")

    def log(self, flat_record: dict[str, float]) -> None:
        """flat_record: {"iteration": n, "lm_loss": ..., "lambda/layer_1": ...}."""
        self.run.log(flat_record)

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() leaves the run's last records in wandb-core's buffer, written as its service shuts down, which
        # W&B does at interpreter exit: `megadiff adapt` ends with os._exit (as multiprocessing's ranks do), and
        # its runs then lost their exit record now and then (W&B showed them running, never finished)
        wandb.teardown()


def wandb_sink(run_dir: str | Path, logging, run_config: dict) -> WandbSink | None:
    """The sink `logging` (a config's logging section: wandb_project, ...) asks for, or None."""
    if not logging.wandb_project:
        return None
    return WandbSink(Path(run_dir), logging.wandb_project, logging.wandb_entity, logging.wandb_run_name, run_config)
