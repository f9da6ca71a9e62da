"""Models on disk and in memory: finding a repository's models and versions (`discovery`),
loading, warming, swapping and unloading them (`manager`), what each costs in memory
(`footprint`), and which stay loaded under the worker's memory budget (`residency`)."""
