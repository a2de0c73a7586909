"""Synthetic knowledge worlds with known answers: `facts` (capitals, languages, currencies of real countries)
and `bio` (invented people with six attributes each), used by training mixes, editing and the experiments."""
