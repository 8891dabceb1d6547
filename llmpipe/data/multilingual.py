"""A small multilingual sample written for llmpipe (en, zh, de, fr, ja, ru, es).

Paragraph-sized texts about everyday topics, so language ID, CJK-aware filters, tokenizer training
and per-language metrics all have real work on a machine with no network.
"""

SAMPLES: dict[str, list[str]] = {
    "en": [
        "The river behind the old mill freezes every winter. Children skate on it in the afternoon, and their parents watch from the bridge with cups of tea. By March the ice turns grey and thin, and the town council puts up signs asking everyone to stay off it.",
        "A good loaf of bread needs only flour, water, salt and time. The dough rests overnight in a cool kitchen, and the slow fermentation gives the crust its colour and the crumb its flavour. Bakers say that patience is the most important ingredient.",
        "Our library opened a small repair café on Saturdays. Volunteers fix lamps, radios and bicycles, and they teach visitors how to do it themselves. Last month they repaired more than forty items that would otherwise have been thrown away.",
        "Trains between the two cities run every half hour during the day. The journey takes about ninety minutes, and most passengers read, work on their laptops or simply look out of the window at the fields and the low hills.",
        "The museum's new exhibition explains how maps were made before satellites. Surveyors walked for months with chains and compasses, measuring angles from hilltops, and the results were surprisingly accurate for their time.",
        "Gardeners in the north plant potatoes in April and harvest them at the end of summer. The soil must be loose and well drained, and the plants need regular watering during dry weeks. A cool cellar keeps the harvest fresh until spring.",
    ],
    "zh": [
        "我们小区旁边新开了一家面包店，每天早上七点开门。店主是一对年轻夫妇，他们坚持用天然酵母发酵，面包的口感非常松软，很多邻居都成了回头客。",
        "春节前夕，火车站里挤满了回家的人。大家提着大包小包，脸上带着期待的笑容。虽然路途遥远，但是一想到能和家人团聚，所有的疲惫都不算什么。",
        "学习一门外语需要耐心和坚持。每天花半个小时阅读和听力练习，比周末突击几个小时效果更好。遇到不懂的词语，可以先猜测意思，再查词典确认。",
        "这座城市的公园里种满了桂花树。每到秋天，空气中弥漫着淡淡的花香，老人们在树下下棋聊天，孩子们在草地上追逐玩耍，一派热闹祥和的景象。",
        "图书馆最近推出了夜间开放服务，晚上十点才闭馆。许多上班族下班后来这里看书学习，安静的环境和舒适的座位让大家感到非常满意。",
        "爷爷年轻时是一名木匠，他做的桌椅结实耐用，几十年过去了依然完好。他常说，做事情要一丝不苟，手艺好不好，时间会给出答案。",
    ],
    "de": [
        "Am Wochenende fahren viele Familien mit dem Fahrrad an den See. Der Weg führt durch Felder und kleine Dörfer, und unterwegs gibt es mehrere Gasthäuser, in denen man eine Pause machen und etwas essen kann.",
        "Die Stadtbibliothek bietet seit diesem Herbst Kurse für ältere Menschen an, die lernen möchten, wie man ein Smartphone benutzt. Die Kurse sind kostenlos und finden jeden Dienstag am Vormittag statt.",
        "Im Frühling beginnt im Garten die meiste Arbeit. Die Beete werden umgegraben, Kompost wird verteilt und die ersten Samen kommen in die Erde. Wer geduldig ist, kann im Sommer eigenes Gemüse ernten.",
        "Der Zug nach München hatte heute Morgen eine Verspätung von zwanzig Minuten. Die Fahrgäste blieben jedoch ruhig, denn der Schaffner informierte sie freundlich über den Grund und die voraussichtliche Ankunftszeit.",
        "Unser Nachbar repariert in seiner Freizeit alte Uhren. In seiner Werkstatt stehen Dutzende Pendeluhren, und jede von ihnen hat eine eigene Geschichte, die er gerne seinen Besuchern erzählt.",
    ],
    "fr": [
        "Le marché du samedi matin attire beaucoup de monde dans le centre du village. On y trouve des fromages, des légumes de saison, du pain frais et des fleurs, et les marchands connaissent la plupart de leurs clients par leur prénom.",
        "Pendant les vacances d'été, la bibliothèque municipale organise des ateliers de lecture pour les enfants. Les bénévoles lisent des contes à voix haute, puis les enfants dessinent leurs personnages préférés.",
        "La randonnée jusqu'au sommet prend environ trois heures. Le sentier traverse une forêt de pins avant d'atteindre les prairies, d'où l'on peut voir le lac et les montagnes voisines par temps clair.",
        "Ma grand-mère préparait une tarte aux pommes chaque dimanche. Elle disait que le secret était une pâte faite à la main et des pommes un peu acides, coupées en tranches très fines.",
        "Le nouveau tramway relie désormais la gare au quartier de l'université. Les habitants apprécient ce moyen de transport rapide et silencieux, qui a aussi réduit la circulation dans les rues du centre.",
    ],
    "ja": [
        "駅前の小さな喫茶店は、朝七時から営業しています。店主が一杯ずつ丁寧にいれるコーヒーが評判で、出勤前の会社員や近所のお年寄りが毎日のように通っています。",
        "秋になると、山の木々が赤や黄色に色づきます。週末には多くの人がハイキングに出かけ、頂上からの美しい景色を楽しみながら、お弁当を食べて一日を過ごします。",
        "図書館では毎月、子ども向けの読み聞かせ会を開いています。ボランティアの方が絵本を読むと、子どもたちは目を輝かせて物語の世界に引き込まれていきます。",
        "祖父は若いころ漁師として働いていました。朝早く船を出し、夕方には魚をたくさん積んで港に戻ってきたそうです。今でも海の話をするときは、とても楽しそうな顔をします。",
        "新しい言語を学ぶときは、毎日少しずつ続けることが大切です。短い文章を声に出して読んだり、好きな歌の歌詞を覚えたりすると、自然に言葉が身についていきます。",
    ],
    "ru": [
        "Зимой в нашем городе рано темнеет, но улицы украшают гирлянды и фонари. По вечерам люди гуляют по центральной площади, катаются на коньках и пьют горячий чай в маленьких кафе.",
        "Бабушка каждое лето варила варенье из малины и смородины. Банки стояли в погребе до самой зимы, и в холодные вечера вся семья собиралась за столом пить чай с вареньем.",
        "Новая линия метро соединила окраину города с центром. Теперь дорога до работы занимает у жителей района вдвое меньше времени, чем раньше, когда приходилось ездить на автобусе.",
        "В школьной библиотеке появился читальный зал с удобными креслами. Ученики приходят туда на переменах, чтобы почитать книги, подготовиться к урокам или просто отдохнуть в тишине.",
        "Осенью в лесу много грибов. Рано утром грибники отправляются в путь с корзинами и возвращаются домой к обеду, довольные своей добычей и свежим воздухом.",
    ],
    "es": [
        "Cada domingo, la plaza del pueblo se llena de puestos de comida, artesanía y música. Las familias pasean bajo los árboles, los niños juegan cerca de la fuente y los mayores charlan sentados en los bancos.",
        "La biblioteca del barrio ofrece clases gratuitas de informática para adultos. Muchos vecinos han aprendido a enviar correos, hacer videollamadas con sus nietos y buscar información en internet.",
        "El camino hacia el faro recorre la costa durante varios kilómetros. Desde allí se ven los acantilados, las pequeñas calas y, con un poco de suerte, algún delfín nadando cerca de la orilla.",
        "Mi abuelo cultivaba tomates, pimientos y calabacines en un huerto detrás de la casa. Decía que las verduras sabían mejor cuando uno mismo las había cuidado desde la semilla.",
        "El nuevo tren de cercanías ha reducido el tiempo de viaje entre la ciudad y los pueblos vecinos. Los estudiantes y trabajadores ya no dependen del coche para llegar a tiempo cada mañana.",
    ],
}
