-- correlation-worker schema, revision 0016, SQLite: one rule for printable names and hints, records that
-- cannot be finished in the future, and values of the wrong type refused under their column's name (see the
-- PostgreSQL file for the rule). SQLite's SQL cannot tell whether a text is in NFC, nor U+FFFE and U+FFFF from
-- U+FFFD (its decoder reads them as U+FFFD): such a name or hint is taken,
-- and the worker dead-letters the message with the reason in last_error instead of calling it. The character
-- lists are SQLite char() arguments derived from worker/policy/text.py (45 is '-', a GLOB range).
--
-- A value of the wrong type (time_to_live 'PT30S', attempt 'x', a blob as a name) was refused by whichever of the
-- column's rules compared it last (text sorts after every number: 'PT30S' broke "at most 1000 years"); each
-- column's type is now a rule of its own, checked before the others (correlation_message_<column>_is_<type>).
--
-- Live messages already in the file that break a rule are made dead first, the rule in last_error (as on
-- PostgreSQL); records finished in the future are made to have finished now.

-- The GLOB patterns of the rule, one row each: the triggers read them (a pattern spelled once, not in each trigger).
CREATE TABLE correlation_text_pattern (
    name    TEXT PRIMARY KEY,
    pattern TEXT NOT NULL
);
INSERT INTO correlation_text_pattern (name, pattern) VALUES
    ('blank_first', '[' || char(9,45,13,32,133,160,5760,8192,45,8202,8232,45,8233,8239,8287,12288) || ']*'),
    ('blank_last', '*[' || char(9,45,13,32,133,160,5760,8192,45,8202,8232,45,8233,8239,8287,12288) || ']'),
    ('not_only_blank', '*[^' || char(9,45,13,32,133,160,5760,8192,45,8202,8204,8205,8232,45,8233,8239,8287,12288) || ']*'),
    ('joiner_first', '[' || char(8204,8205) || ']*'),
    ('joiner_last', '*[' || char(8204,8205) || ']'),
    ('refused', '*[' || char(1,45,31,127,45,159,173,888,45,889,896,45,899,907,909,930,1328,1367,45,1368,1419,45,1420,1424,1480,45,1487,1515,45,1518,1525,45,1541,1564,1757,1806,45,1807,1867,45,1868,1970,45,1983,2043,45,2044,2094,45,2095,2111,2140,45,2141,2143,2155,45,2159,2191,45,2199,2274,2436,2445,45,2446,2449,45,2450,2473,2481,2483,45,2485,2490,45,2491,2501,45,2502,2505,45,2506,2511,45,2518,2520,45,2523,2526,2532,45,2533,2559,45,2560,2564,2571,45,2574) || char(2577,45,2578,2601,2609,2612,2615,2618,45,2619,2621,2627,45,2630,2633,45,2634,2638,45,2640,2642,45,2648,2653,2655,45,2661,2679,45,2688,2692,2702,2706,2729,2737,2740,2746,45,2747,2758,2762,2766,45,2767,2769,45,2783,2788,45,2789,2802,45,2808,2816,2820,2829,45,2830,2833,45,2834,2857,2865,2868,2874,45,2875,2885,45,2886,2889,45,2890,2894,45,2900,2904,45,2907,2910,2916,45,2917,2936,45,2945,2948,2955,45,2957,2961,2966,45,2968,2971,2973,2976,45,2978,2981) || char(45,2983,2987,45,2989,3002,45,3005,3011,45,3013,3017,3022,45,3023,3025,45,3030,3032,45,3045,3067,45,3071,3085,3089,3113,3130,45,3131,3141,3145,3150,45,3156,3159,3163,45,3164,3166,45,3167,3172,45,3173,3184,45,3190,3213,3217,3241,3252,3258,45,3259,3269,3273,3278,45,3284,3287,45,3292,3295,3300,45,3301,3312,3315,45,3327,3341,3345,3397,3401,3408,45,3411,3428,45,3429,3456,3460,3479,45,3481,3506,3516,3518,45,3519,3527,45,3529,3531,45,3534,3541,3543,3552) || char(45,3557,3568,45,3569,3573,45,3584,3643,45,3646,3676,45,3712,3715,3717,3723,3748,3750,3774,45,3775,3781,3783,3790,45,3791,3802,45,3803,3808,45,3839,3912,3949,45,3952,3992,4029,4045,4059,45,4095,4294,4296,45,4300,4302,45,4303,4681,4686,45,4687,4695,4697,4702,45,4703,4745,4750,45,4751,4785,4790,45,4791,4799,4801,4806,45,4807,4823,4881,4886,45,4887,4955,45,4956,4989,45,4991,5018,45,5023,5110,45,5111,5118,45,5119,5789,45,5791,5881,45,5887,5910,45) || char(5918,5943,45,5951,5972,45,5983,5997,6001,6004,45,6015,6110,45,6111,6122,45,6127,6138,45,6143,6158,6170,45,6175,6265,45,6271,6315,45,6319,6390,45,6399,6431,6444,45,6447,6460,45,6463,6465,45,6467,6510,45,6511,6517,45,6527,6572,45,6575,6602,45,6607,6619,45,6621,6684,45,6685,6751,6781,45,6782,6794,45,6799,6810,45,6815,6830,45,6831,6863,45,6911,6989,45,6991,7039,7156,45,7163,7224,45,7226,7242,45,7244,7305,45,7311,7355,45,7356,7368,45,7375) || char(7419,45,7423,7958,45,7959,7966,45,7967,8006,45,8007,8014,45,8015,8024,8026,8028,8030,8062,45,8063,8117,8133,8148,45,8149,8156,8176,45,8177,8181,8191,8203,8206,45,8207,8232,45,8238,8288,45,8303,8306,45,8307,8335,8349,45,8351,8385,45,8399,8433,45,8447,8588,45,8591,9255,45,9279,9291,45,9311,11124,45,11125,11158,11508,45,11512,11558,11560,45,11564,11566,45,11567,11624,45,11630,11633,45,11646,11671,45,11679,11687,11695,11703,11711,11719,11727,11735,11743,11870,45,11903,11930) || char(12020,45,12031,12246,45,12271,12284,45,12287,12352,12439,45,12440,12544,45,12548,12592,12687,12772,45,12783,12831,42125,45,42127,42183,45,42191,42540,45,42559,42744,45,42751,42955,45,42959,42962,42964,42970,45,42993,43053,45,43055,43066,45,43071,43128,45,43135,43206,45,43213,43226,45,43231,43348,45,43358,43389,45,43391,43470,43482,45,43485,43519,43575,45,43583,43598,45,43599,43610,45,43611,43715,45,43738,43767,45,43776,43783,45,43784,43791,45,43792,43799,45,43807,43815,43823,43884,45,43887,44014,45,44015) || char(44026,45,44031,55204,45,55215,55239,45,55242,55292,45,63743,64110,45,64111,64218,45,64255,64263,45,64274,64280,45,64284,64311,64317,64319,64322,64325,64451,45,64466,64912,45,64913,64968,45,64974,64976,45,65007,65050,45,65055,65107,65127,65132,45,65135,65141,65277,45,65280,65471,45,65473,65480,45,65481,65488,45,65489,65496,45,65497,65501,45,65503,65511,65519,45,65531,65548,65575,65595,65598,65614,45,65615,65630,45,65663,65787,45,65791,65795,45,65798,65844,45,65846,65935,65949,45,65951,65953,45,65999,66046,45) || char(66175,66205,45,66207,66257,45,66271,66300,45,66303,66340,45,66348,66379,45,66383,66427,45,66431,66462,66500,45,66503,66518,45,66559,66718,45,66719,66730,45,66735,66772,45,66775,66812,45,66815,66856,45,66863,66916,45,66926,66939,66955,66963,66966,66978,66994,67002,67005,45,67071,67383,45,67391,67414,45,67423,67432,45,67455,67462,67505,67515,45,67583,67590,45,67591,67593,67638,67641,45,67643,67645,45,67646,67670,67743,45,67750,67760,45,67807,67827,67830,45,67834,67868,45,67870,67898,45,67902,67904,45,67967,68024) || char(45,68027,68048,45,68049,68100,68103,45,68107,68116,68120,68150,45,68151,68155,45,68158,68169,45,68175,68185,45,68191,68256,45,68287,68327,45,68330,68343,45,68351,68406,45,68408,68438,45,68439,68467,45,68471,68498,45,68504,68509,45,68520,68528,45,68607,68681,45,68735,68787,45,68799,68851,45,68857,68904,45,68911,68922,45,69215,69247,69290,69294,45,69295,69298,45,69375,69416,45,69423,69466,45,69487,69514,45,69551,69580,45,69599,69623,45,69631,69710,45,69713,69750,45,69758,69821,69827,45,69839,69865,45) || char(69871,69882,45,69887,69941,69960,45,69967,70007,45,70015,70112,70133,45,70143,70162,70207,45,70271,70279,70281,70286,70302,70314,45,70319,70379,45,70383,70394,45,70399,70404,70413,45,70414,70417,45,70418,70441,70449,70452,70458,70469,45,70470,70473,45,70474,70478,45,70479,70481,45,70486,70488,45,70492,70500,45,70501,70509,45,70511,70517,45,70655,70748,70754,45,70783,70856,45,70863,70874,45,71039,71094,45,71095,71134,45,71167,71237,45,71247,71258,45,71263,71277,45,71295,71354,45,71359,71370,45,71423,71451,45) || char(71452,71468,45,71471,71495,45,71679,71740,45,71839,71923,45,71934,71943,45,71944,71946,45,71947,71956,71959,71990,71993,45,71994,72007,45,72015,72026,45,72095,72104,45,72105,72152,45,72153,72165,45,72191,72264,45,72271,72355,45,72367,72441,45,72703,72713,72759,72774,45,72783,72813,45,72815,72848,45,72849,72872,72887,45,72959,72967,72970,73015,45,73017,73019,73022,73032,45,73039,73050,45,73055,73062,73065,73103,73106,73113,45,73119,73130,45,73439,73465,45,73647,73649,45,73663,73714,45,73726,74650,45,74751,74863) || char(74869,45,74879,75076,45,77711,77811,45,77823,78895,45,82943,83527,45,92159,92729,45,92735,92767,92778,45,92781,92863,92874,45,92879,92910,45,92911,92918,45,92927,92998,45,93007,93018,93026,93048,45,93052,93072,45,93759,93851,45,93951,94027,45,94030,94088,45,94094,94112,45,94175,94181,45,94191,94194,45,94207,100344,45,100351,101590,45,101631,101641,45,110575,110580,110588,110591,110883,45,110927,110931,45,110947,110952,45,110959,111356,45,113663,113771,45,113775,113789,45,113791,113801,45,113807,113818,45,113819,113824,45,118527) || char(118574,45,118575,118599,45,118607,118724,45,118783,119030,45,119039,119079,45,119080,119155,45,119162,119275,45,119295,119366,45,119519,119540,45,119551,119639,45,119647,119673,45,119807,119893,119965,119968,45,119969,119971,45,119972,119975,45,119976,119981,119994,119996,120004,120070,120075,45,120076,120085,120093,120122,120127,120133,120135,45,120137,120145,120486,45,120487,120780,45,120781,121484,45,121498,121504,121520,45,122623,122655,45,122879,122887,122905,45,122906,122914,122917,122923,45,123135,123181,45,123183,123198,45,123199,123210,45,123213,123216,45,123535,123567,45) || char(123583,123642,45,123646,123648,45,124895,124903,124908,124911,124927,125125,45,125126,125143,45,125183,125260,45,125263,125274,45,125277,125280,45,126064,126133,45,126208,126270,45,126463,126468,126496,126499,126501,45,126502,126504,126515,126520,126522,126524,45,126529,126531,45,126534,126536,126538,126540,126544,126547,126549,45,126550,126552,126554,126556,126558,126560,126563,126565,45,126566,126571,126579,126584,126589,126591,126602,126620,45,126624,126628,126634,126652,45,126703,126706,45,126975,127020,45,127023,127124,45,127135,127151,45,127152,127168,127184,127222,45,127231,127406,45,127461,127491) || char(45,127503,127548,45,127551,127561,45,127567,127570,45,127583,127590,45,127743,128728,45,128732,128749,45,128751,128765,45,128767,128884,45,128895,128985,45,128991,129004,45,129007,129009,45,129023,129036,45,129039,129096,45,129103,129114,45,129119,129160,45,129167,129198,45,129199,129202,45,129279,129620,45,129631,129646,45,129647,129653,45,129655,129661,45,129663,129671,45,129679,129709,45,129711,129723,45,129727,129734,45,129743,129754,45,129759,129768,45,129775,129783,45,129791,129939,129995,45,130031,130042,45,131071,173792,45,173823,177977,45,177983,178206) || char(45,178207,183970,45,183983,191457,45,194559,195102,45,196607,201547,45,917759,918000,45,1114111) || ']*');

UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0016: the message name has whitespace at either end'
 WHERE state IN ('ready', 'paused') AND (message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_first') OR message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_last'));
UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0016: the message name holds an invisible or control character'
 WHERE state IN ('ready', 'paused') AND (message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'));
UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0016: the correlation hint is only whitespace'
 WHERE state IN ('ready', 'paused') AND (correlation_hint <> '' AND correlation_hint NOT GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'not_only_blank'));
UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0016: the correlation hint holds an invisible or control character'
 WHERE state IN ('ready', 'paused') AND (correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'));
UPDATE correlation_message SET finished_at = strftime('%Y-%m-%d %H:%M:%f000', 'now')
 WHERE state = 'delivered' AND julianday(finished_at) > julianday('now', '+1 minute');

DROP TRIGGER correlation_message_name_no_blank_at_either_end_insert;
DROP TRIGGER correlation_message_name_no_blank_at_either_end_update;
DROP TRIGGER correlation_message_name_printable_insert;
DROP TRIGGER correlation_message_name_printable_update;
DROP TRIGGER correlation_message_hint_not_blank_insert;
DROP TRIGGER correlation_message_hint_not_blank_update;
DROP TRIGGER correlation_message_hint_printable_insert;
DROP TRIGGER correlation_message_hint_printable_update;
DROP TRIGGER correlation_schedule_name_no_blank_at_either_end_insert;
DROP TRIGGER correlation_schedule_name_no_blank_at_either_end_update;
DROP TRIGGER correlation_schedule_name_printable_insert;
DROP TRIGGER correlation_schedule_name_printable_update;
DROP TRIGGER correlation_schedule_message_name_no_blank_at_either_end_insert;
DROP TRIGGER correlation_schedule_message_name_no_blank_at_either_end_update;
DROP TRIGGER correlation_schedule_message_name_printable_insert;
DROP TRIGGER correlation_schedule_message_name_printable_update;
CREATE TRIGGER correlation_message_name_no_blank_at_either_end_insert BEFORE INSERT ON correlation_message
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_no_blank_at_either_end: a message name has no whitespace at either end');
END;
CREATE TRIGGER correlation_message_name_printable_insert BEFORE INSERT ON correlation_message
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_printable: a message name holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_message_name_no_blank_at_either_end_update BEFORE UPDATE OF message_name ON correlation_message
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_no_blank_at_either_end: a message name has no whitespace at either end');
END;
CREATE TRIGGER correlation_message_name_printable_update BEFORE UPDATE OF message_name ON correlation_message
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_printable: a message name holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_message_hint_not_blank_insert BEFORE INSERT ON correlation_message
    WHEN (NEW.correlation_hint <> '' AND NEW.correlation_hint NOT GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'not_only_blank'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_not_blank: a correlation hint is more than whitespace');
END;
CREATE TRIGGER correlation_message_hint_printable_insert BEFORE INSERT ON correlation_message
    WHEN (NEW.correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_printable: a correlation hint holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_message_hint_not_blank_update BEFORE UPDATE OF correlation_hint ON correlation_message
    WHEN (NEW.correlation_hint <> '' AND NEW.correlation_hint NOT GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'not_only_blank'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_not_blank: a correlation hint is more than whitespace');
END;
CREATE TRIGGER correlation_message_hint_printable_update BEFORE UPDATE OF correlation_hint ON correlation_message
    WHEN (NEW.correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.correlation_hint GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_printable: a correlation hint holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_schedule_name_no_blank_at_either_end_insert BEFORE INSERT ON correlation_schedule
    WHEN (NEW.name <> '' AND (NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_first') OR NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_last')))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_no_blank_at_either_end: a schedule name has no whitespace at either end');
END;
CREATE TRIGGER correlation_schedule_name_printable_insert BEFORE INSERT ON correlation_schedule
    WHEN (NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_printable: a schedule name holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_schedule_name_no_blank_at_either_end_update BEFORE UPDATE OF name ON correlation_schedule
    WHEN (NEW.name <> '' AND (NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_first') OR NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_last')))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_no_blank_at_either_end: a schedule name has no whitespace at either end');
END;
CREATE TRIGGER correlation_schedule_name_printable_update BEFORE UPDATE OF name ON correlation_schedule
    WHEN (NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_printable: a schedule name holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_schedule_message_name_no_blank_at_either_end_insert BEFORE INSERT ON correlation_schedule
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_no_blank_at_either_end: a message name has no whitespace at either end');
END;
CREATE TRIGGER correlation_schedule_message_name_printable_insert BEFORE INSERT ON correlation_schedule
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_printable: a message name holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_schedule_message_name_no_blank_at_either_end_update BEFORE UPDATE OF message_name ON correlation_schedule
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'blank_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_no_blank_at_either_end: a message name has no whitespace at either end');
END;
CREATE TRIGGER correlation_schedule_message_name_printable_update BEFORE UPDATE OF message_name ON correlation_schedule
    WHEN (NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'refused')
         OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_first') OR NEW.message_name GLOB (SELECT pattern FROM correlation_text_pattern WHERE name = 'joiner_last'))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_printable: a message name holds no control, invisible or line-breaking character, and a joiner (U+200C, U+200D) only between two characters');
END;
CREATE TRIGGER correlation_message_finished_at_utc_text_insert BEFORE INSERT ON correlation_message
    WHEN NEW.finished_at IS NOT NULL AND (julianday(NEW.finished_at) IS NULL OR NEW.finished_at NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*' OR substr(NEW.finished_at, 20, 1) NOT IN ('', '.') OR substr(NEW.finished_at, 21) GLOB '*[^0-9]*')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_at_utc_text: finished_at is UTC text YYYY-MM-DD HH:MM:SS[.ffffff]');
END;
CREATE TRIGGER correlation_message_finished_at_not_in_the_future_insert BEFORE INSERT ON correlation_message
    WHEN NOT (julianday(NEW.finished_at) IS NULL OR NEW.finished_at NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*' OR substr(NEW.finished_at, 20, 1) NOT IN ('', '.') OR substr(NEW.finished_at, 21) GLOB '*[^0-9]*') AND julianday(NEW.finished_at) > julianday('now', '+1 minute')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_at_not_in_the_future: finished_at is later than the clock; a record holds its message_id until the retention after finished_at (leave finished_at to the worker)');
END;
CREATE TRIGGER correlation_message_finished_at_utc_text_update BEFORE UPDATE OF finished_at ON correlation_message
    WHEN NEW.finished_at IS NOT NULL AND (julianday(NEW.finished_at) IS NULL OR NEW.finished_at NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*' OR substr(NEW.finished_at, 20, 1) NOT IN ('', '.') OR substr(NEW.finished_at, 21) GLOB '*[^0-9]*')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_at_utc_text: finished_at is UTC text YYYY-MM-DD HH:MM:SS[.ffffff]');
END;
CREATE TRIGGER correlation_message_finished_at_not_in_the_future_update BEFORE UPDATE OF finished_at ON correlation_message
    WHEN NOT (julianday(NEW.finished_at) IS NULL OR NEW.finished_at NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*' OR substr(NEW.finished_at, 20, 1) NOT IN ('', '.') OR substr(NEW.finished_at, 21) GLOB '*[^0-9]*') AND julianday(NEW.finished_at) > julianday('now', '+1 minute')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_at_not_in_the_future: finished_at is later than the clock; a record holds its message_id until the retention after finished_at (leave finished_at to the worker)');
END;
CREATE TRIGGER correlation_message_message_id_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.message_id) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_message_id_is_text: message_id is text');
END;
CREATE TRIGGER correlation_message_message_id_is_text_update BEFORE UPDATE OF message_id ON correlation_message
    WHEN typeof(NEW.message_id) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_message_id_is_text: message_id is text');
END;
CREATE TRIGGER correlation_message_message_name_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.message_name) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_message_name_is_text: message_name is text');
END;
CREATE TRIGGER correlation_message_message_name_is_text_update BEFORE UPDATE OF message_name ON correlation_message
    WHEN typeof(NEW.message_name) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_message_name_is_text: message_name is text');
END;
CREATE TRIGGER correlation_message_correlation_hint_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.correlation_hint) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_correlation_hint_is_text: correlation_hint is text');
END;
CREATE TRIGGER correlation_message_correlation_hint_is_text_update BEFORE UPDATE OF correlation_hint ON correlation_message
    WHEN typeof(NEW.correlation_hint) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_correlation_hint_is_text: correlation_hint is text');
END;
CREATE TRIGGER correlation_message_payload_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.payload) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_payload_is_text: payload is text');
END;
CREATE TRIGGER correlation_message_payload_is_text_update BEFORE UPDATE OF payload ON correlation_message
    WHEN typeof(NEW.payload) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_payload_is_text: payload is text');
END;
CREATE TRIGGER correlation_message_headers_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.headers) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_headers_is_text: headers is text');
END;
CREATE TRIGGER correlation_message_headers_is_text_update BEFORE UPDATE OF headers ON correlation_message
    WHEN typeof(NEW.headers) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_headers_is_text: headers is text');
END;
CREATE TRIGGER correlation_message_created_at_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.created_at) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_created_at_is_text: created_at is text');
END;
CREATE TRIGGER correlation_message_created_at_is_text_update BEFORE UPDATE OF created_at ON correlation_message
    WHEN typeof(NEW.created_at) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_created_at_is_text: created_at is text');
END;
CREATE TRIGGER correlation_message_ttl_is_seconds_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.time_to_live) NOT IN ('integer', 'real', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_ttl_is_seconds: time_to_live is a number of seconds (not text such as ''PT30S'')');
END;
CREATE TRIGGER correlation_message_ttl_is_seconds_update BEFORE UPDATE OF time_to_live ON correlation_message
    WHEN typeof(NEW.time_to_live) NOT IN ('integer', 'real', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_ttl_is_seconds: time_to_live is a number of seconds (not text such as ''PT30S'')');
END;
CREATE TRIGGER correlation_message_expires_at_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.expires_at) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_expires_at_is_text: expires_at is text');
END;
CREATE TRIGGER correlation_message_expires_at_is_text_update BEFORE UPDATE OF expires_at ON correlation_message
    WHEN typeof(NEW.expires_at) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_expires_at_is_text: expires_at is text');
END;
CREATE TRIGGER correlation_message_attempt_is_integer_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.attempt) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_attempt_is_integer: attempt is a whole number');
END;
CREATE TRIGGER correlation_message_attempt_is_integer_update BEFORE UPDATE OF attempt ON correlation_message
    WHEN typeof(NEW.attempt) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_attempt_is_integer: attempt is a whole number');
END;
CREATE TRIGGER correlation_message_next_attempt_at_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.next_attempt_at) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_next_attempt_at_is_text: next_attempt_at is text');
END;
CREATE TRIGGER correlation_message_next_attempt_at_is_text_update BEFORE UPDATE OF next_attempt_at ON correlation_message
    WHEN typeof(NEW.next_attempt_at) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_next_attempt_at_is_text: next_attempt_at is text');
END;
CREATE TRIGGER correlation_message_reschedule_count_is_integer_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.reschedule_count) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_reschedule_count_is_integer: reschedule_count is a whole number');
END;
CREATE TRIGGER correlation_message_reschedule_count_is_integer_update BEFORE UPDATE OF reschedule_count ON correlation_message
    WHEN typeof(NEW.reschedule_count) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_reschedule_count_is_integer: reschedule_count is a whole number');
END;
CREATE TRIGGER correlation_message_last_error_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.last_error) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_last_error_is_text: last_error is text');
END;
CREATE TRIGGER correlation_message_last_error_is_text_update BEFORE UPDATE OF last_error ON correlation_message
    WHEN typeof(NEW.last_error) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_last_error_is_text: last_error is text');
END;
CREATE TRIGGER correlation_message_state_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.state) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_state_is_text: state is text');
END;
CREATE TRIGGER correlation_message_state_is_text_update BEFORE UPDATE OF state ON correlation_message
    WHEN typeof(NEW.state) NOT IN ('text')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_state_is_text: state is text');
END;
CREATE TRIGGER correlation_message_slot_is_integer_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.slot) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_slot_is_integer: slot is a whole number');
END;
CREATE TRIGGER correlation_message_slot_is_integer_update BEFORE UPDATE OF slot ON correlation_message
    WHEN typeof(NEW.slot) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_slot_is_integer: slot is a whole number');
END;
CREATE TRIGGER correlation_message_lost_calls_is_integer_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.lost_calls) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_lost_calls_is_integer: lost_calls is a whole number');
END;
CREATE TRIGGER correlation_message_lost_calls_is_integer_update BEFORE UPDATE OF lost_calls ON correlation_message
    WHEN typeof(NEW.lost_calls) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_lost_calls_is_integer: lost_calls is a whole number');
END;
CREATE TRIGGER correlation_message_crashed_calls_is_integer_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.crashed_calls) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_crashed_calls_is_integer: crashed_calls is a whole number');
END;
CREATE TRIGGER correlation_message_crashed_calls_is_integer_update BEFORE UPDATE OF crashed_calls ON correlation_message
    WHEN typeof(NEW.crashed_calls) NOT IN ('integer')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_crashed_calls_is_integer: crashed_calls is a whole number');
END;
CREATE TRIGGER correlation_message_pause_id_is_integer_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.pause_id) NOT IN ('integer', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_pause_id_is_integer: pause_id is a whole number');
END;
CREATE TRIGGER correlation_message_pause_id_is_integer_update BEFORE UPDATE OF pause_id ON correlation_message
    WHEN typeof(NEW.pause_id) NOT IN ('integer', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_pause_id_is_integer: pause_id is a whole number');
END;
CREATE TRIGGER correlation_message_outcome_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.outcome) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_outcome_is_text: outcome is text');
END;
CREATE TRIGGER correlation_message_outcome_is_text_update BEFORE UPDATE OF outcome ON correlation_message
    WHEN typeof(NEW.outcome) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_outcome_is_text: outcome is text');
END;
CREATE TRIGGER correlation_message_result_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.result) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_result_is_text: result is text');
END;
CREATE TRIGGER correlation_message_result_is_text_update BEFORE UPDATE OF result ON correlation_message
    WHEN typeof(NEW.result) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_result_is_text: result is text');
END;
CREATE TRIGGER correlation_message_finished_at_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.finished_at) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_at_is_text: finished_at is text');
END;
CREATE TRIGGER correlation_message_finished_at_is_text_update BEFORE UPDATE OF finished_at ON correlation_message
    WHEN typeof(NEW.finished_at) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_at_is_text: finished_at is text');
END;
CREATE TRIGGER correlation_message_finished_by_is_text_insert BEFORE INSERT ON correlation_message
    WHEN typeof(NEW.finished_by) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_by_is_text: finished_by is text');
END;
CREATE TRIGGER correlation_message_finished_by_is_text_update BEFORE UPDATE OF finished_by ON correlation_message
    WHEN typeof(NEW.finished_by) NOT IN ('text', 'null')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_finished_by_is_text: finished_by is text');
END;
