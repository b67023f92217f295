"""The one default the vocabulary itself needs, written here so that the restart budget
(`slurmft.core.budget`) and the setting of the same name (`policy.max_restarts_without_progress`,
slurmft.config) share it. Imports nothing: every slurmft start reads the settings."""

MAX_RESTARTS_WITHOUT_PROGRESS = 5
