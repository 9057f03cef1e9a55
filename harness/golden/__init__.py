"""The golden store and its comparison lanes: the files (`schema`, `store`: atomic, locked), the machines they belong
to (`hardware` keys, numerics `fingerprint`s), the lanes (`compare`: exact, approximate, timing; `bands`), a case's
check (`case_check`, `results`), recalibration (`recalibrate`), provenance and the errors they raise; `megatron_log`
reads upstream's logs into the same schema."""
