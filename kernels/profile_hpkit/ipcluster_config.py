# ipyparallel profile "hpkit": how the kit's RankCluster starts engines (engine i = rank i).
# Installed into IPYTHONDIR by `python kernels/install.py` (part of `make setup`).
# Use it with RankCluster.start(n, profile="hpkit") or the notebooks' `profile = "hpkit"`.
c = get_config()  # noqa: F821 - injected by IPython's config loader

# Local engines on this machine: the default, and what CI uses.
c.Cluster.engine_launcher_class = "local"
c.Cluster.controller_launcher_class = "local"

# More than one machine: pick one of ipyparallel's launchers instead, e.g.
#
#   MPI (mpiexec starts the engines; ranks follow MPI ranks; the engines need mpi4py; `mpich` and
#   `mpi4py` from PyPI are enough on one machine, as tests/kit_tests/test_launchers.py runs it):
#     c.Cluster.engine_launcher_class = "mpi"
#     c.MPILauncher.mpi_args = ["--hostfile", "/path/to/hosts"]
#
#   Slurm (engines as a batch job step):
#     c.Cluster.engine_launcher_class = "slurm"
#     c.SlurmEngineSetLauncher.batch_template = "..."   # partition, nodes, time
#     c.Cluster.controller_ip = "*"                      # engines connect from other nodes
#
#   SSH (engines on named hosts):
#     c.Cluster.engine_launcher_class = "ssh"
#     c.SSHEngineSetLauncher.engines = {"node1": 2, "node2": 2}
#     c.Cluster.controller_ip = "*"
#
#   Engines started apart (on other machines): `ipcontroller --profile hpkit --cluster-id mine --ip '*'`
#   here, then `ipengine --profile hpkit --cluster-id mine` on each machine, once per rank.
#
# Remote engines reach the driver's TCPStore at HPKIT_STORE_HOST (set it to this machine's
# address) and need GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) naming a routable interface. Each
# rank binds to the accelerator of its index among the ranks of its machine (tests/kit/runtime/devices.py).
