"""The torch-only switch loop: train a step, switch to INFER, run the engine, switch back.

Every iteration prints one table row: the loss, both switch times, bytes moved, and device memory in
TRAIN and INFER; at the end it checks that the engine's output equals the training model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from hybridmem import Direction, HybridConfig, ShardingManager
from hybridmem.accel import get_accelerator
from hybridmem.engines import TorchCopyEngine
from hybridmem.switch.memplan import format_nbytes
from hybridmem.testing.tiny import TinyNet, make_batch, train_step

__all__ = ["main", "run"]


def run(*, iters: int = 10, dim: int = 256, device: str = "auto",
        console: Console | None = None) -> list[dict]:
    """Run the loop; returns one dict of figures per iteration."""
    console = console or Console()
    config = HybridConfig(device=device)
    torch.manual_seed(0)
    accel = get_accelerator(config.device)
    model = TinyNet(dim=dim, vocab=512).to(accel.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = TorchCopyEngine(model, kv_cache_nbytes=8 * dim * 1024)
    manager = ShardingManager(model, engine, optimizer=opt, config=config, accel=accel)
    table = Table(title=f"hybridmem switch loop on {accel.device} (TinyNet dim={dim})")
    for col in ("iter", "loss", "to INFER ms", "to TRAIN ms", "moved", "GB/s", "device TRAIN",
                "device INFER"):
        table.add_column(col, justify="right")
    rows = []
    for it in range(iters):
        loss = train_step(model, opt, it)
        with manager.inference() as eng:
            tokens, _ = make_batch(it, accel.device, vocab=512)
            logits = eng(tokens)
        to_infer, to_train = (manager.last_reports[Direction.TO_INFER],
                              manager.last_reports[Direction.TO_TRAIN])
        row = {
            "iter": it,
            "loss": loss,
            "to_infer_ms": to_infer.seconds * 1e3,
            "to_train_ms": to_train.seconds * 1e3,
            "copied_nbytes": to_infer.copied_nbytes + to_train.copied_nbytes,
            "gbps": to_infer.gbps,
            "device_train_nbytes": to_infer.device_before_nbytes,
            "device_infer_nbytes": to_infer.device_after_nbytes,
        }
        rows.append(row)
        table.add_row(str(it), f"{loss:.4f}", f"{row['to_infer_ms']:.1f}", f"{row['to_train_ms']:.1f}",
                      format_nbytes(row["copied_nbytes"]), f"{row['gbps']:.2f}",
                      format_nbytes(row["device_train_nbytes"]), format_nbytes(row["device_infer_nbytes"]))
    console.print(table)
    with torch.no_grad():
        expected = model(tokens)
    same = torch.equal(logits, expected)
    console.print(f"engine output equals the training model's: {same}")
    console.print(manager.last_reports[Direction.TO_INFER])
    if not same:
        raise SystemExit("engine output differs from the training model's")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``hybridmem switch-loop``: parse and check arguments, then run."""
    from hybridmem.config.arguments import OneLineErrorParser  # noqa: PLC0415

    parser = OneLineErrorParser(
        prog="hybridmem switch-loop",
        description="The torch-only switch loop: train a step, switch to INFER, run the engine, switch back; "
        "one table row per iteration.",
    )
    parser.add_argument("--iters", type=int, default=10, help="iterations (default 10)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, npu, cuda:N or npu:N")
    args = parser.parse_args(argv)
    for flag, value in (("--iters", args.iters), ("--dim", args.dim)):
        if value < 1:
            parser.error(f"{flag} {value} is not allowed: expected an integer >= 1")
    from hybridmem.config import DEVICE_CHOICES  # noqa: PLC0415

    try:
        HybridConfig(device=args.device)
        get_accelerator(args.device)
    except (ValueError, RuntimeError) as exc:
        parser.error(f"--device {args.device} is not usable here ({exc}); allowed: "
                     f"{', '.join(DEVICE_CHOICES)}, cuda:N, npu:N where the backend is present "
                     "(auto picks one)")
    run(iters=args.iters, dim=args.dim, device=args.device)
