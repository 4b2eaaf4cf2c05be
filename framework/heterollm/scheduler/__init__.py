from heterollm.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
