"""Running the core: the driver and its ports (:mod:`.driver`, :mod:`.ports`), their live
implementations (:mod:`.live_ports`, :mod:`.lifecycle`, :mod:`.rendezvous`), gossip news
(:mod:`.news`), the step protocol (:mod:`.steps`) and state transfer (:mod:`.transfer`).
The simulation's implementations of the ports are :mod:`ftcomm.groupsim`'s."""
