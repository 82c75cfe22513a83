"""The mechanisms policies hold: small parts with their own knobs, composed by each policy
file (none of them is a policy, none imports one)."""
