"""Test tooling: workloads, fault injectors and the exactly-once checker. Used by the fault
tests and `make soak`; not part of the shipped `offsetflow` package."""
