"""Pipeline schedules as data (torch-free, both wings): the op orders of 1F1B, interleaved, ZB-H1 and ZB-V
(``schedules``), the p2p program derived from them (``p2p``) and their timelines, simulated or executed
(``timeline``)."""
