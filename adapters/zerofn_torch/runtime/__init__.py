"""How the adapter runs the core's programs on a process group: the driver
(:mod:`~zerofn_torch.runtime.driver`) steps a program and issues each request
as a collective (:mod:`~zerofn_torch.runtime.issue`), chaining futures that
keep their errors (:mod:`~zerofn_torch.runtime.futures`), where a failed
collective becomes a :class:`zerofn.errors.CollectiveError`
(:mod:`~zerofn_torch.runtime.collective_errors`); collectives of picklable
values (:mod:`~zerofn_torch.runtime.object_collectives`); core hooks on DDP's
buckets (:mod:`~zerofn_torch.runtime.hook_cells`,
:mod:`~zerofn_torch.runtime.foreign_hooks`); and the worlds programs run in:
local worlds of ranks (:mod:`~zerofn_torch.runtime.launch`), shaped links
(:mod:`~zerofn_torch.runtime.links`) and the traffic counted on them
(:mod:`~zerofn_torch.runtime.traffic`); and the face of an optimizer that
wraps another (:mod:`~zerofn_torch.runtime.wrapped_optimizer`)."""
