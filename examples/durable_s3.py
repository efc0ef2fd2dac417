"""A run whose steps are also kept in an S3 bucket: save, lose the local disk, restore from the bucket.

    python examples/durable_s3.py --endpoint http://127.0.0.1:8333 --bucket fp-dcp

Works with any S3-compatible server (MinIO, SeaweedFS, Ceph RGW) or AWS S3
itself (leave out ``--endpoint``). Needs s3fs (``pip install fp-dcp[s3]``);
the bucket must exist. The credentials and the region come from
``--key``/``--secret``/``--region``, else from the environment variables
s3fs reads (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``; ``AWS_ENDPOINT_URL`` for the endpoint).

It trains a small model for 3 steps under a ``CheckpointManager`` whose
durable tier is ``FsspecStore("s3://BUCKET/PREFIX", ...)``: every step is
drained to the bucket, uploaded, read back and checked, and the bucket
keeps the newest two (``keep_durable=2``). Then the local root is deleted,
as when a job restarts on a new machine, and a new manager restores the
newest step from the bucket into a fresh model, which must equal the
trained one bit for bit. The prefix is emptied at the start, so the example
can run again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fp_dcp import CheckpointManager
from fp_dcp.tiers import FsspecStore, Retry


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bucket", required=True, help="an existing bucket")
    ap.add_argument("--prefix", default="fp-dcp-example", help="where in the bucket the run's steps go")
    ap.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"), help="the S3 server's URL")
    ap.add_argument("--key", default=os.environ.get("AWS_ACCESS_KEY_ID"), help="access key id")
    ap.add_argument("--secret", default=os.environ.get("AWS_SECRET_ACCESS_KEY"), help="secret access key")
    ap.add_argument("--region", default=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    ap.add_argument("--root", help="the local root (default: a temporary directory, removed at the end)")
    return ap.parse_args()


def open_store(args: argparse.Namespace) -> FsspecStore:
    """The bucket as a durable store: the keyword arguments go to s3fs.S3FileSystem."""
    store = FsspecStore(
        f"s3://{args.bucket}/{args.prefix}",
        endpoint_url=args.endpoint,  # None: AWS S3 (or AWS_ENDPOINT_URL)
        key=args.key,  # None: botocore's credential chain (environment, ~/.aws, instance role)
        secret=args.secret,
        client_kwargs={"region_name": args.region},
    )
    store.retry = Retry(attempts=4, delay=1.0)  # each upload: 4 tries, 1 s, 2 s, 4 s apart
    return store


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a step saves; DCP's get_state_dict also gives a fresh optimizer's state tensors to load into."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def same_training(
    a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[torch.nn.Module, torch.optim.Optimizer]
) -> bool:
    """Whether two models and their AdamW states are equal, bit for bit."""
    pairs = list(zip(a[0].parameters(), b[0].parameters(), strict=True))
    return all(torch.equal(p, q) for p, q in pairs) and all(
        torch.equal(a[1].state[p][k], b[1].state[q][k]) for p, q in pairs for k in ("step", "exp_avg", "exp_avg_sq")
    )


def main() -> None:
    args = parse_args()
    root = args.root or tempfile.mkdtemp(prefix="fp-dcp-durable-")
    store = open_store(args)
    if store.fs.exists(store.root):
        store.fs.rm(store.root, recursive=True)  # an earlier run of this example

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    with CheckpointManager(root, durable=store, keep_last=2, keep_durable=2) as mgr:
        for step in (1, 2, 3):
            model(torch.randn(32, 256)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            mgr.save(step, training_state(model, optimizer))
        mgr.wait_for_copies()  # the drains run in the background: wait for the last one
        if mgr.durable_error is not None:
            raise mgr.durable_error
    kept = sorted(int(step.removeprefix("step-")) for step, names in store.inventory().items() if ".metadata" in names)
    print(f"saved steps 1, 2, 3; {store.url} holds steps {kept}")

    shutil.rmtree(root)  # this machine's disk is gone
    fresh = torch.nn.Linear(256, 256)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    state = training_state(fresh, fresh_optimizer)
    with CheckpointManager(root, durable=open_store(args)) as mgr:
        step = mgr.restore(state)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = same_training((fresh, fresh_optimizer), (model, optimizer))
    print(f"local root deleted; restored step {step} from {store.url}: {'bit-exact' if same else 'DIFFERENT'}")
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    main()
