"""The default held-out text of the decoder budget metrics (``ppl_ratio``, ``greedy_match``).

Plain English prose on everyday topics, written for graphopt (no data set is copied), used when no text
is given (``--calib FILE.txt``). ``graphopt.generate.quality`` cuts its tokens into windows and gives
alternate windows to calibration and to the held-back check, so the two never share a token.
"""

from __future__ import annotations

TEXT = """\
The river that runs through the old town was once the reason the town existed. Boats carried grain, wool and \
timber down to the coast, and the warehouses along the water were built with wide doors so that carts could be \
loaded straight from the quay. When the railway arrived, the boats slowly disappeared, and for many years the \
warehouses stood empty. Today most of them have been turned into flats, small shops and a market that opens \
every Saturday morning.

Bread is one of the oldest prepared foods. A simple loaf needs only flour, water, salt and yeast, but the way \
these are combined changes everything. A long, slow rise in a cool kitchen gives the dough time to develop \
flavour, while a warm room and a short rise produce a lighter, milder loaf. Bakers often keep a small amount of \
dough from one day to start the next, a habit that has been passed down for generations.

Learning a second language as an adult is difficult, but it is far from impossible. The most useful habit is to \
practise a little every day instead of a lot once a week. Reading short stories, listening to the radio and \
speaking with patient friends all help. Mistakes are part of the process: each one shows what still needs work, \
and most people are happy to help a learner who is trying.

The heart is a muscle about the size of a closed fist. It beats roughly one hundred thousand times a day, pushing \
blood through a network of vessels that, laid end to end, would stretch for many thousands of kilometres. \
Regular exercise makes the heart stronger and more efficient, so that it can pump the same amount of blood with \
fewer beats. Sleep, a varied diet and not smoking matter just as much.

In the early days of computing, machines filled entire rooms and were programmed by setting switches or feeding \
in punched cards. A single calculation could take hours, and a mistake in one card meant starting again. As \
transistors replaced valves and chips replaced circuit boards, computers became smaller, cheaper and much faster. \
The phone in a typical pocket today has more memory than every computer in the world had in the nineteen sixties.

Gardening teaches patience. Seeds planted in spring may not flower until summer, and fruit trees can take years \
before they bear a good crop. A gardener learns to watch the weather, to notice which plants enjoy the sun and \
which prefer the shade, and to accept that slugs, birds and late frosts will take their share. The reward is a \
table full of vegetables that taste better than anything bought in a shop.

Maps have always shaped how people see the world. Early sailors drew coastlines from memory and rumour, leaving \
the interior of continents blank or filling it with imagined mountains. Careful surveys with chains, compasses \
and later satellites slowly replaced guesswork with measurement. Even so, every map is a choice about what to \
show and what to leave out, and two maps of the same place can tell very different stories.

A good meeting has a clear purpose, a short list of topics and a time limit that everyone respects. Someone \
should write down what was decided and who will do what by when. Without these simple rules, meetings tend to \
drift, the loudest voices win, and people leave unsure of what happens next. Many teams find that a fifteen \
minute conversation standing up does more than an hour around a table.

Winter in the mountains is quiet. Snow covers the paths, the streams freeze at their edges, and most birds have \
flown south. The animals that stay have their own ways of coping: some grow thicker coats, some store food in \
autumn, and some sleep through the coldest months. On a clear night the stars are so bright that the snow seems \
to glow, and the only sound is the wind moving through the pines.
"""
