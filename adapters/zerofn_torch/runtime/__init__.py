"""How the adapter runs the core's programs on a process group: the driver
(:mod:`~zerofn_torch.runtime.driver`) steps a program and issues each request
as a collective (:mod:`~zerofn_torch.runtime.issue`), chaining futures that
keep their errors (:mod:`~zerofn_torch.runtime.futures`), where a failed
collective becomes a :class:`zerofn.errors.CollectiveError`
(:mod:`~zerofn_torch.runtime.collective_errors`); collectives of picklable
values (:mod:`~zerofn_torch.runtime.object_collectives`); core hooks on DDP's
buckets (:mod:`~zerofn_torch.runtime.hook_cells`,
:mod:`~zerofn_torch.runtime.foreign_hooks`); local worlds of ranks that
programs run in (:mod:`~zerofn_torch.runtime.launch`) and the traffic counted
in them (:mod:`~zerofn_torch.runtime.traffic`); and the face of an optimizer
that wraps another (:mod:`~zerofn_torch.runtime.wrapped_optimizer`)."""
