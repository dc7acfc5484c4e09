//! The master plan: tasks, patches and their deterministic merge.
