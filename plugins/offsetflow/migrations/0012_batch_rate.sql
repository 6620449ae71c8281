-- Adaptive batch sizing (source.rate: {adaptive: pid}): the rate a scheduled batch was sized
-- for and why (the observation, the PID terms, the caps that won), and the estimator's state
-- the next plan starts from. NULL: the batch was sized by the fixed caps only.
ALTER TABLE offsetflow.batches ADD COLUMN rate jsonb;
