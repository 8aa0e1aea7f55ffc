"""Public background prompts for calibrating FedDPA's instance-wise weight (paper 000 section 4.3).

The calibrated weighting (:mod:`routing.calibration`) needs to know what "any prompt at all" looks like
to the model, so that a client's own prompts can be told from everything else without reading another
client's data. These generic instructions, written for this project (no data set was copied), span the
usual shapes of instruction data: open questions, how-to, writing and rewriting, short classification
with options, yes/no questions, arithmetic, code, extraction, summaries and translation. They are
public: every client embeds the same list with the same global adapter, so they reveal nothing about
any client. Callers format them with the run's prompt template before embedding.
"""

from __future__ import annotations

import hashlib

BACKGROUND_NAME = "generic-v1"

BACKGROUND_PROMPTS: tuple[str, ...] = (
    # open questions
    "What causes the seasons on Earth?",
    "Why is the sky blue during the day and red at sunset?",
    "How does a vaccine train the immune system?",
    "What is the difference between weather and climate?",
    "Who invented the printing press, and why did it matter?",
    "How do bees make honey?",
    "What is inflation in economics?",
    "Why do cats purr?",
    "How far is the Moon from the Earth?",
    "What does a project manager do all day?",
    "Which planets in the solar system have rings?",
    "What is the boiling point of water at the top of a high mountain, and why is it different?",
    "How do noise-cancelling headphones work?",
    "What is the main function of the kidneys?",
    "When did the first humans reach Australia?",
    "What is a haiku?",
    "Why do leaves change colour in autumn?",
    "How many bones are in the adult human body?",
    "What is the difference between a virus and a bacterium?",
    "What does GDP measure?",
    # how-to and advice
    "How do I make a simple tomato sauce?",
    "Give me three tips for sleeping better.",
    "How should I prepare for a job interview?",
    "What is a good way to start learning to play the guitar?",
    "How can I keep houseplants alive while I travel for two weeks?",
    "Suggest a weekly routine for someone who wants to start running.",
    "How do I change a flat tyre on a bicycle?",
    "What should I pack for a weekend camping trip?",
    "How can a small team run better meetings?",
    "Explain how to plant tulip bulbs.",
    "What are some ways to save money on groceries?",
    "How do I write a polite email declining an invitation?",
    # writing
    "Write a short poem about the sea at night.",
    "Write a two-sentence horror story.",
    "Write a product description for a reusable water bottle.",
    "Draft a thank-you note to a neighbour who watered my garden.",
    "Write a limerick about a forgetful wizard.",
    "Write the opening paragraph of a mystery novel set in a lighthouse.",
    "Compose a short speech for a friend's retirement party.",
    "Write a tweet announcing the opening of a new bakery.",
    "Describe a busy train station in the morning.",
    "Write a dialogue between a customer and a librarian.",
    "Invent a name and a slogan for a bicycle repair shop.",
    "Write a short fable with a moral about patience.",
    # rewriting and editing
    "Rewrite this sentence in a more formal tone: hey, can u send me the report asap?",
    "Make this sentence shorter: In spite of the fact that it was raining, we decided to go out for a walk.",
    "Correct the spelling in this sentence: Thier freinds recieved the pakage yesterday.",
    "Turn this list into a sentence: eggs, flour, milk, sugar.",
    "Rewrite the following in the passive voice: The committee approved the new budget.",
    "Paraphrase: The meeting has been postponed until further notice.",
    "Change this sentence to the past tense: She walks to school and meets her friends.",
    "Simplify this for a child: Photosynthesis converts light energy into chemical energy.",
    "Capitalize the title correctly: the old man and the sea",
    "Expand this note into a full sentence: meeting moved - Tues 3pm - room B.",
    # classification with options
    "Is the following review positive or negative? The soup was cold and the waiter ignored us.\n\n"
    "OPTIONS:\n- positive\n- negative",
    "Which category does this headline belong to? Local team wins the championship after extra time.\n\n"
    "OPTIONS:\n- sports\n- politics\n- business\n- science",
    "Is this statement a fact or an opinion? Chocolate ice cream is the best dessert.\n\n"
    "OPTIONS:\n- fact\n- opinion",
    "What is the tone of this message? I can't believe you forgot my birthday again.\n\n"
    "OPTIONS:\n- happy\n- upset\n- neutral",
    "Pick the animal that is a mammal.\n\nOPTIONS:\n- shark\n- dolphin\n- trout",
    "Which of these is a programming language?\n\nOPTIONS:\n- Python\n- Cobra\n- Viper",
    "Is this email spam? Congratulations, you have won a free cruise, click here now!\n\n"
    "OPTIONS:\n- spam\n- not spam",
    "Choose the word that does not belong: apple, banana, carrot, cherry.\n\n"
    "OPTIONS:\n- apple\n- banana\n- carrot\n- cherry",
    "How urgent is this ticket? The login page is down for all users.\n\nOPTIONS:\n- low\n- medium\n- high",
    "Which season is described? The days are short, it snows and people wear heavy coats.\n\n"
    "OPTIONS:\n- spring\n- summer\n- autumn\n- winter",
    "Is the following sentence a question or a command? Close the door behind you.\n\n"
    "OPTIONS:\n- question\n- command",
    "Does this text talk about health or about travel? I booked a cheap flight to Lisbon for May.\n\n"
    "OPTIONS:\n- health\n- travel",
    # yes/no and true/false
    "Is a tomato a fruit?",
    "Can penguins fly? Answer yes or no.",
    "True or false: the Pacific is the largest ocean.",
    "Is 91 a prime number?",
    "Does water expand when it freezes?",
    "Is it safe to look directly at the sun during an eclipse?",
    "Answer yes or no: is Paris the capital of Italy?",
    "True or false: sound travels faster than light.",
    # arithmetic and reasoning
    "What is 17 multiplied by 6?",
    "A shirt costs 20 dollars and is discounted by 25 percent. What is the new price?",
    "If a train travels 60 kilometres in 45 minutes, what is its average speed in kilometres per hour?",
    "Sort these numbers from smallest to largest: 42, 7, 19, 3, 88.",
    "What is the next number in the sequence 2, 4, 8, 16?",
    "Tom is older than Ann, and Ann is older than Joe. Who is the youngest?",
    "How many minutes are there in three and a half hours?",
    "Divide 144 by 12 and add 5.",
    "A recipe for 4 people needs 300 grams of rice. How much rice is needed for 6 people?",
    "If today is Wednesday, what day will it be in ten days?",
    # code
    "Write a Python function that returns the largest number in a list.",
    "Explain what a for loop does in programming.",
    "What does this code print? print(len('hello world'))",
    "Write a SQL query that counts the rows of a table named orders.",
    "How do I reverse a string in JavaScript?",
    "What is the difference between a list and a tuple in Python?",
    "Write a regular expression that matches a five-digit postal code.",
    "Explain what an API is to a non-programmer.",
    # extraction and structure
    "Extract the dates from this text: The fair opens on 3 June and closes on 17 June.",
    "List the people mentioned: Maria called Tom, and later Tom met Aisha at the station.",
    "Turn this into a JSON object: name Alice, age 34, city Denver.",
    "What is the main verb in the sentence: The old dog slept under the table?",
    "Find the email address in this line: contact us at help@example.org for support.",
    "Name the country and the city in this sentence: We spent a week in Kyoto, Japan.",
    "Make a table with two columns, fruit and colour, for apple, banana and grape.",
    "Give the antonym of each word: hot, early, empty.",
    "What are the nouns in this sentence? The girl put the book on the shelf.",
    "Count the words in this sentence: The quick brown fox jumps over the lazy dog.",
    # summaries and explanations
    "Summarize in one sentence: The city council met on Monday to discuss the new park. Residents asked "
    "for more trees and a playground, and the council agreed to publish a plan next month.",
    "Explain the rules of chess in a few sentences.",
    "Give a short summary of the story of Cinderella.",
    "Explain what a black hole is in simple terms.",
    "Summarize the advantages of working from home.",
    "In two sentences, explain why exercise is good for mental health.",
    "What is the main idea of this paragraph? Many birds migrate south in winter to find food. They "
    "return in spring when insects and plants are plentiful again.",
    "Describe how a bill becomes a law, briefly.",
    # translation and language
    "Translate into French: Where is the nearest pharmacy?",
    "Translate into Spanish: I would like a cup of coffee, please.",
    "What does the German word 'Schadenfreude' mean?",
    "Give a synonym for 'happy'.",
    "Use the word 'reluctant' in a sentence.",
    "What is the plural of 'mouse'?",
    "Translate into English: Buongiorno, come stai?",
    "Explain the difference between 'affect' and 'effect'.",
    # comparison and opinion
    "Compare cats and dogs as pets.",
    "What are the pros and cons of electric cars?",
    "Which is healthier, walking or cycling?",
    "Compare reading a paper book with reading an e-book.",
    "Should schools start later in the morning? Give arguments on both sides.",
    "What are the differences between a lake and a pond?",
    # lists and brainstorming
    "List five countries in South America.",
    "Name three famous painters from the Renaissance.",
    "Give me ideas for a rainy afternoon with children.",
    "List the primary colours.",
    "Suggest four names for a pet goldfish.",
    "What are some common symptoms of the flu?",
    "Brainstorm themes for a school science fair.",
    "List the days of the week in reverse order.",
    # conversation and short replies
    "Hi! How are you today?",
    "Tell me a joke about computers.",
    "Can you recommend a good book for a long flight?",
    "I feel nervous about my exam tomorrow. Any advice?",
    "What should I cook for dinner tonight?",
    "Tell me an interesting fact about octopuses.",
    "What is your favourite season and why?",
    "Say something encouraging to a friend who lost a game.",
    # facts and definitions
    "Define the word 'ecosystem'.",
    "What is the capital of Canada?",
    "Who wrote the play Romeo and Juliet?",
    "What is the chemical symbol for gold?",
    "What language is spoken in Brazil?",
    "What is the tallest mountain in Africa?",
    "What is a noun?",
    "Define 'democracy' in one sentence.",
    "Which gas do plants absorb from the air?",
    "What is the freezing point of water in Fahrenheit?",
)


def background_id(prompts: tuple[str, ...] | list[str] = BACKGROUND_PROMPTS) -> str:
    """A short content hash naming a background set, stored with each calibration built from it."""
    digest = hashlib.sha256("\n\0".join(prompts).encode()).hexdigest()[:12]
    return f"{BACKGROUND_NAME}:{digest}" if tuple(prompts) == BACKGROUND_PROMPTS else f"custom:{digest}"
