"""fd across instances, through Redis (``fd serve --scheduler-name global``, ``fd router``):

* ``global_scheduler`` -- the protocol: per-instance queues, load reports that expire, work
  stealing, a dead instance's queue taken over, aborts, the choice of an instance
* ``instance``         -- the engine core's side (``ClusterInbox``)
* ``client``           -- ``fd router``'s engine client (``ClusterClient``)
* ``config``           -- ``SchedulerConfig``, the ``--scheduler-*`` flags

docs/DEPLOYMENT.md says how the processes fit together.
"""
