"""Sharded optimizer checkpoints: every rank writes and reads only what it
owns, through ``torch.distributed.checkpoint``, all or nothing
(:mod:`~zerofn_torch.checkpoint.sharded`: save, load, the newest complete
one), with the save protocol (:mod:`~zerofn_torch.checkpoint.save`), saves in
the background (:mod:`~zerofn_torch.checkpoint.background`) and the files on
disk (:mod:`~zerofn_torch.checkpoint.files`).

    from zerofn_torch.checkpoint import save_sharded, load_sharded, latest_checkpoint
"""

from zerofn_torch.checkpoint.sharded import (
    SaveHandle,
    latest_checkpoint,
    load_sharded,
    save_sharded,
)

__all__ = ["SaveHandle", "latest_checkpoint", "load_sharded", "save_sharded"]
