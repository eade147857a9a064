"""Pure arithmetic of the update: plans, update rules, the performance model and the iteration model.

Nothing here runs an update or touches a device stream; the layers above (engine, planning, integration)
import it, it imports none of them.
"""
